/**
 * The 64-bit key of an advisory lock: the first 8 bytes of
 * sha256(namespace NUL name), not `hashtext`'s 32 bits (with 32 bits, ~77k
 * lock names give even odds of two names sharing a lock).
 */
import { createHash } from 'node:crypto';
import { checkLockName, checkNamespace } from '../../options.js';

/**
 * The 64-bit advisory-lock key of `name` in `namespace`: the first 8 bytes
 * of sha256(namespace, NUL, NFC name) as a signed bigint, ready for
 * `pg_try_advisory_lock(bigint)`. For operators: find the holding session
 * with `pg_locks` where `classid`/`objid` are {@link advisoryKeyParts}.
 * @throws {InvalidArgumentError} for a bad name or namespace.
 */
export function advisoryKey(namespace: string, name: string): bigint {
  const digest = createHash('sha256')
    .update(`${checkNamespace(namespace)}\u0000${checkLockName(name)}`, 'utf8')
    .digest();
  return digest.readBigInt64BE(0);
}

/** How `pg_locks` shows a bigint advisory key: `classid` = high 32 bits, `objid` = low 32 bits (with `objsubid = 1`). */
export function advisoryKeyParts(key: bigint): { classid: bigint; objid: bigint } {
  const unsigned = BigInt.asUintN(64, key);
  return { classid: unsigned >> 32n, objid: unsigned & 0xffff_ffffn };
}
