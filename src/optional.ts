/**
 * Loads an optional peer dependency when a feature that needs it is used,
 * never at import time: `import 'palisade-db'` (or `require` of it) works
 * with only drizzle-orm installed, and a missing package is reported by
 * name instead of as a bare module-resolution error.
 */
import { MissingDependencyError } from './errors.js';

/** The optional peer dependencies (see package.json `peerDependenciesMeta`). */
export type OptionalPeer =
  | 'postgres'
  | 'pg'
  | 'ioredis'
  | 'etcd3'
  | '@electric-sql/pglite'
  | '@electric-sql/pglite-socket'
  | 'drizzle-orm/postgres-js'
  | 'drizzle-orm/pglite';

/**
 * `import(name)`, or a {@link MissingDependencyError} naming the package to
 * install when it is not installed. Other failures (the package is there but
 * throws while loading) pass through unchanged.
 * @param purpose what needs it, for the message (`advisoryLockManager`).
 */
export async function loadPeer<T>(name: OptionalPeer, purpose: string): Promise<T> {
  try {
    return (await import(name)) as T;
  } catch (err) {
    if (isMissing(err, name)) {
      const pkg = name.startsWith('drizzle-orm/') ? packageOf(String((err as Error).message), name) : name;
      throw new MissingDependencyError(pkg, purpose, err);
    }
    throw err;
  }
}

// A missing entry point or a missing package it needs (drizzle-orm/pglite imports @electric-sql/pglite).
function isMissing(err: unknown, name: string): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  if (code !== 'ERR_MODULE_NOT_FOUND' && code !== 'MODULE_NOT_FOUND') return false;
  const message = String((err as { message?: unknown }).message);
  return message.includes(`'${name}'`) || name.startsWith('drizzle-orm/');
}

function packageOf(message: string, fallback: string): string {
  return /Cannot find (?:package|module) '((?:@[^/']+\/)?[^/']+)/.exec(message)?.[1] ?? fallback;
}
