import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { InvalidArgumentError, LockUnavailableError } from '../errors.js';
import { observeAcquire } from '../telemetry/otel.js';
import type { LockBackend, LockInfo } from './backend.js';
import { Emitter, type LockEvents } from './events.js';
import { ActiveLease, type Lease } from './lease.js';
import { type AcquireOptions, type CheckedOptions, checkLockName, checkOptions } from './options.js';

const DEFAULT_WAIT_MS = 10_000;
const BACKOFF_BASE_MS = 5;
const BACKOFF_CAP_MS = 250;

/**
 * Grants leases that carry fences. Every backend (Redis, Postgres leases,
 * Postgres advisory locks) offers this same interface.
 *
 * A lock manager makes mutual exclusion *likely* (an efficiency lock). Only
 * the fence, checked by the resource — a `fencedRepository` — makes a write
 * by a holder that lost its lease fail (a correctness lock).
 */
export interface LockManager {
  /** Which backend grants the leases. */
  readonly kind: string;
  /** `acquired`, `extended`, `released` and `lost`, for logs and metrics. */
  readonly events: Pick<Emitter<LockEvents>, 'on'>;
  /**
   * Waits (at most `waitMs`, default 10 s; exponential backoff with full
   * jitter, woken early when the lock is released) and returns a lease.
   * One token for the whole wait, so a backend with a fair order (Redis)
   * keeps this caller's place in line across its retries.
   * @throws {LockUnavailableError} when the wait ends or `signal` aborts.
   * @throws {InvalidArgumentError} for bad input, before any round trip.
   */
  acquire(name: string, options: AcquireOptions): Promise<Lease>;
  /**
   * One attempt, no waiting: a lease, or `null` if the lock is held (use
   * `inspect` to see by whom) — or, on a backend with a fair order (Redis),
   * if callers are waiting in line for it: `tryAcquire` never jumps the queue.
   */
  tryAcquire(name: string, options: AcquireOptions): Promise<Lease | null>;
  /** Acquires, runs `fn(lease)`, and always releases, whether `fn` returns or throws. */
  using<T>(name: string, options: AcquireOptions, fn: (lease: Lease) => Promise<T> | T): Promise<T>;
  /** Who holds `name`, with which fence, since when and for how much longer; `null` if free. */
  inspect(name: string): Promise<LockInfo | null>;
  /**
   * Takes several locks in one consistent order (sorted, duplicates removed)
   * so two callers naming them in opposite orders cannot deadlock; all or
   * nothing: on failure the ones taken are released. `waitMs` bounds the
   * whole call.
   */
  acquireAll(names: readonly string[], options: AcquireOptions): Promise<Lease[]>;
  /** Frees the backend's own resources. Does not release leases or close the caller's clients. */
  close(): Promise<void>;
}

/**
 * Builds a {@link LockManager} from a backend's primitives: validation,
 * bounded waiting, leases with local deadlines and watchdogs, events.
 */
export function createLockManager(backend: LockBackend): LockManager {
  const events = new Emitter<LockEvents>();

  async function attempt(
    name: string,
    opts: CheckedOptions,
    startedAt: number,
    token: string,
    waiting: boolean,
  ): Promise<Lease | null> {
    const sentAt = performance.now();
    const grant = await backend.grant(name, token, opts.ttlMs, opts.holder, { waiting });
    if (!grant) return null;
    const lease = new ActiveLease({
      backend,
      events,
      name,
      token,
      fence: grant.fence,
      holder: opts.holder,
      ttlMs: opts.ttlMs,
      sentAt,
      backendLost: grant.lost,
      autoExtend: opts.autoExtend,
      maxHoldMs: opts.maxHoldMs,
    });
    events.emit('acquired', { name, fence: grant.fence, holder: opts.holder, waitedMs: performance.now() - startedAt });
    return lease;
  }

  // One token for the whole call: a backend with a fair order keeps the
  // token's place in its queue across attempts (a re-sent grant with the
  // same token returns the same fence, so reuse is safe).
  async function acquireUntil(name: string, opts: CheckedOptions, deadline: number): Promise<Lease> {
    const startedAt = performance.now();
    const token = randomBytes(16).toString('hex');
    let queued = false;
    try {
      for (let tries = 0; ; tries++) {
        if (opts.signal?.aborted) throw new LockUnavailableError(name, 'aborted');
        queued = true;
        const lease = await attempt(name, opts, startedAt, token, true);
        if (lease) {
          queued = false;
          return lease;
        }
        const left = deadline - performance.now();
        if (left <= 0) throw new LockUnavailableError(name, 'timeout');
        // Full jitter spreads retries (and, in a queue, refreshes our place);
        // a release notification cuts the wait short.
        const backoff = Math.random() * Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** Math.min(tries, 16));
        await backend.waitForRelease(name, Math.min(left, backoff), opts.signal, token);
      }
    } finally {
      // Gave up (timeout, abort, error): leave the queue, best effort, without delaying the throw.
      if (queued) backend.leave?.(name, token).catch(() => {});
    }
  }

  const manager: LockManager = {
    kind: backend.kind,
    events,

    async acquire(name, options) {
      const checked = checkLockName(name);
      const opts = checkOptions(options, DEFAULT_WAIT_MS);
      const deadline = performance.now() + opts.waitMs;
      return observeAcquire(backend.kind, checked, () => acquireUntil(checked, opts, deadline));
    },

    async tryAcquire(name, options) {
      const checked = checkLockName(name);
      const opts = checkOptions(options, 0);
      const token = randomBytes(16).toString('hex');
      return observeAcquire(backend.kind, checked, () => attempt(checked, opts, performance.now(), token, false));
    },

    async using(name, options, fn) {
      if (typeof fn !== 'function') throw new InvalidArgumentError('using() needs a function to run under the lock');
      const lease = await manager.acquire(name, options);
      try {
        return await fn(lease);
      } finally {
        await lease.release();
      }
    },

    async inspect(name) {
      return backend.inspect(checkLockName(name));
    },

    async acquireAll(names, options) {
      if (!Array.isArray(names) || names.length === 0)
        throw new InvalidArgumentError('acquireAll needs a non-empty array of names');
      const sorted = [...new Set(names.map(checkLockName))].sort(compareCodePoints);
      const opts = checkOptions(options, DEFAULT_WAIT_MS);
      const deadline = performance.now() + opts.waitMs;
      const held: Lease[] = [];
      try {
        for (const name of sorted)
          held.push(await observeAcquire(backend.kind, name, () => acquireUntil(name, opts, deadline)));
        return held;
      } catch (err) {
        await Promise.allSettled(held.map((lease) => lease.release()));
        throw err;
      }
    },

    close: () => backend.close(),
  };
  return manager;
}

// UTF-16 code-unit order: the same in every process and locale (unlike localeCompare).
function compareCodePoints(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}
