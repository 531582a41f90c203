/**
 * Validation of what callers pass to a lock manager, done before any round
 * trip so bad input never reaches Redis or Postgres.
 */
import { InvalidArgumentError } from '../errors.js';

/** Longest lock name, in UTF-8 bytes. */
export const MAX_NAME_BYTES = 1024;
/** Longest lease: one day. A TTL is mandatory and bounded (`PX 1e17` would never expire). */
export const MAX_TTL_MS = 86_400_000;
/** Longest bounded wait: one day. */
export const MAX_WAIT_MS = 86_400_000;
const MAX_HOLDER_LENGTH = 256;
/**
 * The shortest server-side lock wait a grant is given on the Postgres
 * backends (Postgres reads `lock_timeout = 0` as "no limit"): `tryAcquire`,
 * and an acquire's last attempt, may wait this long for a concurrent grant
 * or release of the same row to commit.
 */
export const MIN_GRANT_LOCK_WAIT_MS = 50;
/** Default bound (`lockTimeoutMs`) of a database lock wait inside extend, release and inspect on the Postgres backends. */
export const DEFAULT_LOCK_TIMEOUT_MS = 5_000;

/** Default `commandTimeoutMs` of the Postgres backends: how long a call may take past its server-side lock wait. */
export const POSTGRES_COMMAND_TIMEOUT_MS = 10_000;

/**
 * @internal Checks a lock manager's `commandTimeoutMs` (an integer in 1 …
 * 600,000 ms; the Redis and Postgres managers), `fallback` when absent.
 * @throws {InvalidArgumentError}
 */
export function checkCommandTimeout(value: unknown, fallback: number): number {
  const ms = value ?? fallback;
  if (!Number.isInteger(ms) || (ms as number) < 1 || (ms as number) > 600_000) {
    throw new InvalidArgumentError('commandTimeoutMs must be an integer in 1 … 600,000');
  }
  return ms as number;
}

const PLAIN_ASCII = /^[\x20-\x7e]+$/;
const NAMESPACE = /^[A-Za-z0-9_.-]{1,100}$/;

/**
 * @internal Checks a lock-manager namespace, the one rule of every backend:
 * 1–100 characters of `[A-Za-z0-9_.-]` (safe inside a Redis hash tag, an etcd
 * key path and a NOTIFY payload).
 * @throws {InvalidArgumentError}
 */
export function checkNamespace(namespace: unknown): string {
  if (typeof namespace !== 'string' || !NAMESPACE.test(namespace)) {
    throw new InvalidArgumentError('namespace must be 1–100 characters of A–Z, a–z, 0–9, _ . -');
  }
  return namespace;
}

/** Options of `acquire`, `tryAcquire`, `using` and `acquireAll`. */
export interface AcquireOptions {
  /** Lease time to live, an integer in 1 … 86,400,000 ms. Expiry is decided by the server's clock. */
  readonly ttlMs: number;
  /** How long `acquire` may wait for the lock (default 10,000 ms; `tryAcquire` never waits). */
  readonly waitMs?: number;
  /**
   * Aborts the wait at once (`LockUnavailableError` with reason `aborted`), even while an attempt has no
   * answer yet: a grant that lands after is given back. Does not release a held lease.
   */
  readonly signal?: AbortSignal;
  /** A label for whoever holds the lease (host, pid, job id), shown by `inspect`: at most 256 characters, no NUL. */
  readonly holder?: string;
  /** Extend the lease every ttl/3 while it is held (a watchdog). A boolean: anything else is refused. */
  readonly autoExtend?: boolean;
  /**
   * With `autoExtend: true` (refused without it, where it would do nothing): stop extending this many ms after
   * the grant, so a stuck holder cannot keep the lock forever.
   */
  readonly maxHoldMs?: number;
}

/** Options after validation, with defaults applied. */
export interface CheckedOptions {
  readonly ttlMs: number;
  readonly waitMs: number;
  readonly signal: AbortSignal | undefined;
  readonly holder: string | null;
  readonly autoExtend: boolean;
  readonly maxHoldMs: number | undefined;
}

/**
 * Checks a lock name and returns it in Unicode NFC, so the composed and
 * decomposed spellings of one name are one lock.
 * @throws {InvalidArgumentError} empty, NUL, lone surrogates, or over 1,024 UTF-8 bytes.
 */
export function checkLockName(name: unknown): string {
  // Printable ASCII is well-formed, NFC already and one byte per character: the common case, checked once.
  if (typeof name === 'string' && name.length <= MAX_NAME_BYTES && PLAIN_ASCII.test(name)) return name;
  if (typeof name !== 'string' || name.length === 0)
    throw new InvalidArgumentError('lock name must be a non-empty string');
  if (!name.isWellFormed())
    throw new InvalidArgumentError('lock name must be well-formed Unicode (no lone surrogates)');
  if (name.includes('\u0000')) throw new InvalidArgumentError('lock name must not contain NUL');
  const normal = name.normalize('NFC');
  if (Buffer.byteLength(normal, 'utf8') > MAX_NAME_BYTES) {
    throw new InvalidArgumentError(`lock name must be at most ${MAX_NAME_BYTES} UTF-8 bytes`);
  }
  return normal;
}

/** @throws {InvalidArgumentError} unless `ttlMs` is an integer in 1 … 86,400,000. */
export function checkTtl(ttlMs: unknown, what = 'ttlMs'): number {
  if (typeof ttlMs !== 'number' || !Number.isInteger(ttlMs) || ttlMs < 1 || ttlMs > MAX_TTL_MS) {
    throw new InvalidArgumentError(`${what} must be an integer in 1 … ${MAX_TTL_MS}`);
  }
  return ttlMs;
}

/** Validates acquire options and applies defaults. */
export function checkOptions(options: AcquireOptions | undefined, defaultWaitMs: number): CheckedOptions {
  if (options === null || typeof options !== 'object')
    throw new InvalidArgumentError('lock options are required (ttlMs at least)');
  const ttlMs = checkTtl(options.ttlMs);
  const waitMs = options.waitMs ?? defaultWaitMs;
  if (typeof waitMs !== 'number' || !Number.isFinite(waitMs) || waitMs < 0 || waitMs > MAX_WAIT_MS) {
    throw new InvalidArgumentError(`waitMs must be a number in 0 … ${MAX_WAIT_MS}`);
  }
  if (options.signal !== undefined && !(options.signal instanceof AbortSignal)) {
    throw new InvalidArgumentError('signal must be an AbortSignal');
  }
  const holder = options.holder ?? null;
  if (
    holder !== null &&
    (typeof holder !== 'string' ||
      holder.length > MAX_HOLDER_LENGTH ||
      !holder.isWellFormed() ||
      holder.includes('\u0000'))
  ) {
    // NUL: Postgres text cannot hold it (SQLSTATE 22021) — refused here, not by the server.
    throw new InvalidArgumentError(
      `holder must be a well-formed string without NUL of at most ${MAX_HOLDER_LENGTH} characters`,
    );
  }
  const autoExtend = options.autoExtend === undefined ? false : options.autoExtend;
  // Not truthiness: 'yes' or 'false' would silently mean "no watchdog" (or the opposite).
  if (typeof autoExtend !== 'boolean') throw new InvalidArgumentError('autoExtend must be true or false');
  const maxHoldMs = options.maxHoldMs;
  if (maxHoldMs !== undefined && (typeof maxHoldMs !== 'number' || !Number.isInteger(maxHoldMs) || maxHoldMs < 1)) {
    throw new InvalidArgumentError('maxHoldMs must be a positive integer');
  }
  // maxHoldMs bounds the watchdog; without one it would do nothing, silently.
  if (maxHoldMs !== undefined && !autoExtend) {
    throw new InvalidArgumentError('maxHoldMs needs autoExtend: true (it limits how long the watchdog extends)');
  }
  return { ttlMs, waitMs, signal: options.signal, holder, autoExtend, maxHoldMs };
}

/**
 * How long past an acquire's deadline the Postgres managers wait for the
 * server's answer to a grant that the server itself bounds (`lock_timeout`):
 * round trip and scheduling slack on a busy machine.
 */
export const SERVER_WAIT_GRACE_MS = 2_000;
