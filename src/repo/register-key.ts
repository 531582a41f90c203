/**
 * The key of a lock's fence register: one uuid for the four parts of a
 * {@link LockIdentity}, so the hot path of a lock-scoped write sends one
 * parameter and probes one fixed-width index (README, "Two scopes of
 * fencing"). Its SQL twin is `palisade.lock_key(…)` (migration 0007), which
 * fills `palisade.lock_registers.lock_key`: the first 16 bytes of the
 * SHA-256 of each part's UTF-8 bytes, each preceded by its length (4 bytes,
 * big-endian). The length prefixes make the encoding injective.
 */
import { createHash } from 'node:crypto';
import type { LockIdentity } from '../fencing/lock-identity.js';

// Lock identities of leases are frozen and live as long as the lease: one hash each.
const keys = new WeakMap<LockIdentity, string>();

/** @internal The register key of `lock`, as `palisade.lock_key` computes it (uuid text). */
export function registerKey(lock: LockIdentity): string {
  let key = keys.get(lock);
  if (key === undefined) {
    const hash = createHash('sha256');
    for (const part of [lock.kind, lock.source, lock.namespace, lock.name]) {
      const bytes = Buffer.from(part, 'utf8');
      const length = Buffer.allocUnsafe(4);
      length.writeUInt32BE(bytes.length);
      hash.update(length).update(bytes);
    }
    const hex = hash.digest('hex');
    key = `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20, 32)}`;
    if (Object.isFrozen(lock)) keys.set(lock, key);
  }
  return key;
}

/**
 * @internal The register keys of `locks` as `palisade.tag_claims` takes them (a JSON array): a
 * statement that keeps its claims past its own end tags its transaction as their sharer, so that a
 * raise can tell which sessions share a register (migration 0009).
 */
export const registerTags = (locks: readonly LockIdentity[]): string => JSON.stringify(locks.map(registerKey));
