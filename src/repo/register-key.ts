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
 * @internal The two integers that tag a transaction as a sharer of `lock`'s register (a shared
 * transaction-level advisory lock, two-integer form): the first two 4-byte words of its register key,
 * top bit cleared — what `palisade.register_tag` computes (migration 0009), where a raise looks them up.
 */
export function registerTag(lock: LockIdentity): readonly [number, number] {
  const hex = registerKey(lock);
  return [
    Number.parseInt(hex.slice(0, 8), 16) & 0x7fffffff,
    Number.parseInt(hex.slice(9, 13) + hex.slice(14, 18), 16) & 0x7fffffff,
  ];
}
