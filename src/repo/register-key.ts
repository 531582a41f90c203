/**
 * The key of a lock's fence register: one uuid for the four parts of a
 * {@link LockIdentity}, so the hot path of a lock-scoped write sends one
 * parameter and probes one fixed-width index (README, "Two scopes of
 * fencing"). Its SQL twin is `palisade.lock_key(…)` (migration 0011), which
 * fills `palisade.lock_registers.lock_key`: the first 8 bytes of the SHA-256
 * of kind, source and namespace, then the first 8 bytes of the SHA-256 of
 * all four parts — each part's UTF-8 bytes preceded by their length (4
 * bytes, big-endian), which makes the encoding injective. The first half
 * keeps one namespace's registers side by side in the index.
 */
import { createHash } from 'node:crypto';
import type { LockIdentity } from '../fencing/lock-identity.js';

// Lock identities of leases are frozen and live as long as the lease: one hash each.
const keys = new WeakMap<LockIdentity, string>();

/** @internal The register key of `lock`, as `palisade.lock_key` computes it (uuid text). */
export function registerKey(lock: LockIdentity): string {
  let key = keys.get(lock);
  if (key === undefined) {
    const namespace = Buffer.concat([lock.kind, lock.source, lock.namespace].map(encoded));
    const name = encoded(lock.name);
    const hex =
      createHash('sha256').update(namespace).digest('hex').slice(0, 16) +
      createHash('sha256').update(namespace).update(name).digest('hex').slice(0, 16);
    key = `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20, 32)}`;
    if (Object.isFrozen(lock)) keys.set(lock, key);
  }
  return key;
}

// A part as the key hashes it: its UTF-8 length (4 bytes, big-endian), then its UTF-8 bytes.
function encoded(part: string): Buffer {
  const bytes = Buffer.from(part, 'utf8');
  const length = Buffer.allocUnsafe(4);
  length.writeUInt32BE(bytes.length);
  return Buffer.concat([length, bytes]);
}

// The tag of each lock's last fence: a lease's writes tag with the same one again and again.
const tags = new WeakMap<LockIdentity, { fence: bigint; tag: readonly [number, number] }>();

/**
 * @internal The two integers that tag a transaction as a sharer of `lock`'s register at `fence` (a shared
 * transaction-level advisory lock, two-integer form): the first 4-byte word of its register key's second
 * half (the one the lock's name moves), and the first of the SHA-256 of the key's 32 hex digits, `:` and
 * the fence in decimal, top bits cleared — what `palisade.register_tag` computes (migration 0011), where
 * a raise looks up the sharers at the register's fence (never the raising lease's own sessions, tagged at
 * its higher fence).
 */
export function registerTag(lock: LockIdentity, fence: bigint): readonly [number, number] {
  const last = tags.get(lock);
  if (last?.fence === fence) return last.tag;
  const hex = registerKey(lock).replaceAll('-', '');
  const mixed = createHash('sha256').update(`${hex}:${fence}`).digest('hex');
  const tag = [
    Number.parseInt(hex.slice(16, 24), 16) & 0x7fffffff,
    Number.parseInt(mixed.slice(0, 8), 16) & 0x7fffffff,
  ] as const;
  if (Object.isFrozen(lock)) tags.set(lock, { fence, tag });
  return tag;
}
