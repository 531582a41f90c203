/**
 * What names a lock for its fence register: see README, "Two scopes of
 * fencing". The repository knows a lease only through this and its fence.
 */
import { InvalidArgumentError } from '../errors.js';

/**
 * The lock a lease was granted for, as its fence register is keyed. Two
 * leases are of the same lock only when all four parts are equal; fences of
 * different `kind` or `source` are never compared.
 */
export interface LockIdentity {
  /** The backend that granted it: `postgres` (leases), `advisory`, `redis`, `etcd`, or a user backend's kind. */
  readonly kind: string;
  /**
   * Which fence counter issued the fence: one Postgres database's sequence
   * (`palisade.fence_source_id()` of that database), one Redis deployment,
   * one etcd cluster.
   */
  readonly source: string;
  /** The lock manager's namespace. */
  readonly namespace: string;
  /** The lock's name. */
  readonly name: string;
}

/** @internal The most UTF-8 bytes of each part of a lock identity. */
export const PART_BYTES = 1024;

// A lease's identity is frozen and checked once: repo.with(lease) on every write finds it here.
const checked = new WeakMap<object, LockIdentity>();

/**
 * Checks a {@link LockIdentity} given by a caller (four non-empty strings of
 * at most 1,024 UTF-8 bytes, well-formed, no NUL) and returns a frozen copy — the same
 * copy every time it is given the same frozen value (a lease's).
 * @throws {InvalidArgumentError} otherwise, before any query.
 */
export function checkLockIdentity(value: unknown): LockIdentity {
  if (value === null || typeof value !== 'object') {
    throw new InvalidArgumentError('lock must be { kind, source, namespace, name }');
  }
  const known = checked.get(value);
  if (known !== undefined) return known;
  const v = value as Record<string, unknown>;
  // Each part is read once: what is checked is what is kept (a getter may answer differently twice).
  const parts = { kind: v.kind, source: v.source, namespace: v.namespace, name: v.name };
  for (const [part, s] of Object.entries(parts)) {
    if (typeof s !== 'string' || (part !== 'namespace' && s.length === 0) || s.includes('\u0000')) {
      throw new InvalidArgumentError(`lock.${part} must be a non-empty string without NUL`);
    }
    // The register key hashes UTF-8, where every lone surrogate becomes U+FFFD: '\uD800', '\uDC00'
    // and '\uFFFD' would share one register (lock names are refused likewise, options.ts).
    if (!s.isWellFormed())
      throw new InvalidArgumentError(`lock.${part} must be well-formed Unicode (no lone surrogates)`);
    if (Buffer.byteLength(s, 'utf8') > PART_BYTES) {
      throw new InvalidArgumentError(`lock.${part} must be at most ${PART_BYTES} UTF-8 bytes`);
    }
  }
  const identity = Object.freeze(parts) as LockIdentity;
  // Only a frozen value can be remembered: an open one may change before the next call.
  if (Object.isFrozen(value)) checked.set(value, identity);
  checked.set(identity, identity);
  return identity;
}
