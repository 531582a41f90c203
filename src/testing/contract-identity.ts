/**
 * The lock identity check of the lock backend contract (see contract.ts and
 * the README's "Writing a lock backend" and "Two scopes of fencing"): what
 * lock-scoped writes need of a backend's grants.
 */
import type { Grant, LockBackend } from '../fencing/backend.js';
import { createLockManager } from '../fencing/lock-manager.js';
import type { ContractExpect, ContractSubject } from './contract.js';
import { contractToken, grantFree } from './contract-checks.js';

/** Grants `name` to a new token (the lock is expected free), hands the grant to `seen`, releases. */
async function grantOnce(backend: LockBackend, name: string, ttlMs: number, seen: Grant[]): Promise<void> {
  const token = contractToken();
  seen.push(await grantFree(backend, name, token, ttlMs));
  await backend.release(name, token);
}

/**
 * A backend that declares `namespace` names the source of every fence: each
 * grant (of any lock, the same lock again) carries the same non-empty
 * `source`, and a lease from `createLockManager` exposes `lease.lock` =
 * `{ kind, source, namespace, name }`. A backend without `namespace` gives
 * leases no lock (row scope only).
 */
export async function checkLockIdentityCarried(subject: ContractSubject, expect: ContractExpect, ttlMs: number) {
  const { backend } = subject;
  const namespace = backend.namespace;
  const manager = createLockManager(backend, subject.hooks);
  if (namespace === undefined) {
    const lease = await manager.acquire('identity', { ttlMs, waitMs: 0 });
    try {
      expect(lease.lock).toBe(undefined);
    } finally {
      await lease.release();
    }
    return;
  }
  expect(typeof namespace === 'string' ? 'a string' : typeof namespace).toBe('a string');
  const grants: Grant[] = [];
  for (const name of ['identity', 'identity', 'identity-other']) await grantOnce(backend, name, ttlMs, grants);
  const sources = grants.map((g) => g.source);
  const source = sources[0];
  expect(typeof source === 'string' && source.length > 0 ? 'a non-empty string' : String(source)).toBe(
    'a non-empty string',
  );
  expect(sources).toEqual(grants.map(() => source));
  const lease = await manager.acquire('identity', { ttlMs, waitMs: 0 });
  try {
    expect(lease.lock).toEqual({ kind: backend.kind, source, namespace, name: 'identity' });
  } finally {
    await lease.release();
  }
}
