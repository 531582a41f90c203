/**
 * Optional peer dependencies are loaded by what uses them, and a missing one
 * is palisade's error naming the package to install — not a bare
 * ERR_MODULE_NOT_FOUND. (The package test proves the other half: apps
 * without postgres, pg, ioredis or etcd3 installed import palisade-db and
 * write fenced.)
 */
import { describe, expect, it } from 'vitest';
import { MissingDependencyError } from '../src/errors.js';
import { loadPeer, type OptionalPeer } from '../src/optional.js';

describe('loadPeer', () => {
  it('loads an installed peer', async () => {
    const mod = await loadPeer<{ default: unknown }>('postgres', 'a test');
    expect(typeof mod.default).toBe('function');
  });

  it('names the package to install when it is missing', async () => {
    const err = await loadPeer('palisade-not-installed' as OptionalPeer, 'advisoryLockManager').catch(
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(MissingDependencyError);
    expect(err).toMatchObject({ code: 'missing_dependency', packageName: 'palisade-not-installed' });
    expect((err as Error).message).toBe(
      'advisoryLockManager needs the package "palisade-not-installed": npm i palisade-not-installed',
    );
    expect((err as Error).cause).toBeDefined();
  });
});
