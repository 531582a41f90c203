import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { InvalidArgumentError, LockServiceError, LockUnavailableError, PalisadeError } from '../errors.js';
import { observeAcquire } from '../telemetry/locks.js';
import type { LockBackend, LockInfo } from './backend.js';
import { Emitter, type LockEvents } from './events.js';
import { ActiveLease, type Lease } from './lease.js';
import { type AcquireOptions, type CheckedOptions, checkLockName, checkOptions } from './options.js';

const DEFAULT_WAIT_MS = 10_000;
const BACKOFF_BASE_MS = 5;
const BACKOFF_CAP_MS = 250;
/** The least time an attempt of a waiting acquire gets, even at the very end of the wait. */
const MIN_ATTEMPT_MS = 100;

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
   * A lock service that cannot be reached (Redis down, a connection not
   * yet up) is retried within the same wait, each attempt cut short at the
   * deadline.
   * @throws {LockUnavailableError} when the wait ends or `signal` aborts.
   * @throws {LockServiceError} when the wait ends and the last attempts failed to reach the service (the message says why, e.g. connection refused).
   * @throws {InvalidArgumentError} for bad input, before any round trip.
   */
  acquire(name: string, options: AcquireOptions): Promise<Lease>;
  /**
   * One attempt, no waiting: a lease, or `null` if the lock is held (use
   * `inspect` to see by whom) — or, on a backend with a fair order (Redis),
   * if callers are waiting in line for it: `tryAcquire` never jumps the queue.
   * @throws {LockServiceError} if the service could not be reached.
   */
  tryAcquire(name: string, options: AcquireOptions): Promise<Lease | null>;
  /**
   * Acquires, runs `fn(lease)`, and always releases, whether `fn` returns or
   * throws. `fn`'s outcome wins: its result is returned, or its error thrown,
   * even when the release then fails (the database is gone, a lock wait timed
   * out). A failed release is reported as a `lost` event (reason `release
   * failed: …`): the lease's signal is aborted and the lock frees by itself at
   * its TTL (advisory locks: when the session is ended). It is not thrown,
   * because the work under the lock is done and a caller that retried it
   * would do it twice.
   */
  using<T>(name: string, options: AcquireOptions, fn: (lease: Lease) => Promise<T> | T): Promise<T>;
  /**
   * Who holds `name`, with which fence, since when and for how much longer; `null` if free.
   * @throws {LockServiceError} if the service could not be reached.
   */
  inspect(name: string): Promise<LockInfo | null>;
  /**
   * Takes several locks in one consistent order (sorted, duplicates removed)
   * so two callers naming them in opposite orders cannot deadlock; all or
   * nothing: on failure the ones taken are released. `waitMs` bounds the
   * whole call.
   */
  acquireAll(names: readonly string[], options: AcquireOptions): Promise<Lease[]>;
  /**
   * Frees the backend's own resources: its LISTEN connection or
   * subscription, and (advisory) the sessions of held leases, which loses
   * those leases. Call it at shutdown: until then an advisory or Postgres
   * manager keeps connections open, which keeps the process alive. Does not
   * close the caller's clients.
   */
  close(): Promise<void>;
}

/** What a backend's client can add to the manager's errors. */
export interface LockManagerHooks {
  /** The client's last connection error, if it is not connected (what ioredis reported in its `error` event). */
  readonly lastConnectionError?: () => unknown;
  /**
   * For a backend that bounds its own grant by the wait left (Postgres'
   * `lock_timeout`): how much longer than the deadline the manager waits for
   * the server's answer before it cuts the attempt short, so a grant the
   * server refused on time is a timeout, not "no answer". Default 0.
   */
  readonly waitGraceMs?: number;
}

/**
 * Builds a {@link LockManager} from a backend's primitives: validation,
 * bounded waiting, leases with local deadlines and watchdogs, events.
 */
export function createLockManager(backend: LockBackend, hooks: LockManagerHooks = {}): LockManager {
  const events = new Emitter<LockEvents>();

  async function attempt(
    name: string,
    opts: CheckedOptions,
    startedAt: number,
    token: string,
    waiting: boolean,
    deadline: number,
    cutAt = Number.POSITIVE_INFINITY,
  ): Promise<Lease | null> {
    const sentAt = performance.now();
    // The backend bounds its own server-side wait by what is left of waitMs (Postgres: lock_timeout).
    const waitMs = Math.max(0, deadline - sentAt);
    const grant = await bounded(
      backend.grant(name, token, opts.ttlMs, opts.holder, { waiting, waitMs }),
      cutAt,
      // A grant that lands after we gave up: give it back at once rather than let it sit for its TTL.
      (late) => {
        if (late) backend.release(name, token).catch(() => {});
      },
    );
    if (!grant) return null;
    const lease = new ActiveLease({
      backend,
      events,
      name,
      token,
      fence: grant.fence,
      lock:
        grant.source === undefined || backend.namespace === undefined
          ? undefined
          : Object.freeze({ kind: backend.kind, source: grant.source, namespace: backend.namespace, name }),
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
    let unreachable: unknown;
    let answered = false;
    try {
      for (let tries = 0; ; tries++) {
        if (opts.signal?.aborted) throw new LockUnavailableError(name, 'aborted');
        queued = true;
        let lease: Lease | null = null;
        try {
          // With a wait, an attempt is cut short at the deadline (give or take MIN_ATTEMPT_MS):
          // a client that queues commands while offline must not stretch waitMs to its own timeout.
          const cutAt =
            opts.waitMs > 0
              ? Math.max(deadline + (hooks.waitGraceMs ?? 0), performance.now() + MIN_ATTEMPT_MS)
              : Infinity;
          lease = await attempt(name, opts, startedAt, token, true, deadline, cutAt);
          unreachable = undefined;
          answered = true;
        } catch (err) {
          // The service may come back (a restart, a connection not up yet): retry within the wait.
          if (!isUnreachable(err, hooks)) throw serviceError(hooks, backend.kind, err);
          unreachable = err;
        }
        if (lease) {
          queued = false;
          return lease;
        }
        const left = deadline - performance.now();
        if (left <= 0) {
          // A last attempt cut short after others were answered is a plain timeout, not an outage.
          const outage = unreachable !== undefined && !(answered && unreachable instanceof AttemptCutShort);
          if (outage) throw serviceError(hooks, backend.kind, unreachable, opts.waitMs);
          throw new LockUnavailableError(name, 'timeout');
        }
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
      const now = performance.now();
      const token = randomBytes(16).toString('hex');
      return observeAcquire(backend.kind, checked, async () => {
        try {
          return await attempt(checked, opts, now, token, false, now);
        } catch (err) {
          throw serviceError(hooks, backend.kind, err);
        }
      });
    },

    async using(name, options, fn) {
      if (typeof fn !== 'function') throw new InvalidArgumentError('using() needs a function to run under the lock');
      const lease = await manager.acquire(name, options);
      try {
        return await fn(lease);
      } finally {
        // Awaited before fn's outcome is delivered, but never in its place: release() does not throw
        // (an unconfirmed release is 'lost' and a `lost` event).
        await lease.release();
      }
    },

    async inspect(name) {
      const checked = checkLockName(name);
      try {
        return await backend.inspect(checked);
      } catch (err) {
        throw serviceError(hooks, backend.kind, err);
      }
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

const SENTINEL_TIMEOUT = Symbol('deadline');

/**
 * `work`, or a timeout error at `deadline` (a monotonic time). If the work
 * settles after the deadline, `onLate(value)` gets its value (undefined if it
 * failed) so a grant nobody waits for can be given back.
 */
async function bounded<T>(work: Promise<T>, deadline: number, onLate: (value: T | undefined) => void): Promise<T> {
  const left = deadline - performance.now();
  if (!Number.isFinite(left)) return work;
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<typeof SENTINEL_TIMEOUT>((resolve) => {
    timer = setTimeout(() => resolve(SENTINEL_TIMEOUT), Math.max(0, left));
  });
  try {
    const first = await Promise.race([work, timeout]);
    if (first !== SENTINEL_TIMEOUT) return first;
  } finally {
    clearTimeout(timer);
  }
  work.then(onLate, () => onLate(undefined));
  throw new AttemptCutShort();
}

/** An attempt abandoned at the wait's deadline (it may still land: then it is given back). */
class AttemptCutShort extends Error {
  constructor() {
    super('no answer before the wait ended');
  }
}

// Errors that say "the service did not answer", not "the service said no": worth another attempt.
const NETWORK_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'EPIPE',
  'ETIMEDOUT',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
  'CONNECTION_CLOSED',
  'CONNECTION_ENDED',
  'CONNECTION_DESTROYED',
  'CONNECT_TIMEOUT',
]);
const UNREACHABLE_MESSAGE =
  /Stream isn't writeable|Connection is closed|connect ECONNREFUSED|ECONNRESET|Reached the max retries per request|UNAVAILABLE|DEADLINE_EXCEEDED|No connection established|Connection terminated/i;

function isUnreachable(err: unknown, hooks: LockManagerHooks): boolean {
  if (err instanceof AttemptCutShort) return true;
  for (let e: unknown = err, depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    if (code === 'lock_service') return true;
    // A timeout on a connected client is the service's answer (it may still apply): not retried here.
    if (code === 'command_timeout') return hooks.lastConnectionError?.() !== undefined;
    if (typeof code === 'string' && (NETWORK_CODES.has(code) || /^(08|57P0)/.test(code))) return true;
    if (e instanceof Error && UNREACHABLE_MESSAGE.test(e.message)) return true;
  }
  return false;
}

/**
 * palisade's own errors pass through (an unreachable service excepted when
 * a wait ended); anything else a backend's client threw (ioredis, etcd3,
 * a socket) becomes a {@link LockServiceError} that keeps it as its cause.
 */
function serviceError(hooks: LockManagerHooks, kind: string, err: unknown, waitedMs?: number): Error {
  const connection = hooks.lastConnectionError?.();
  if (err instanceof PalisadeError) {
    // At the end of a wait `err` is one isUnreachable accepted (a database connection error, a
    // command timeout while disconnected); elsewhere only a timeout while disconnected is
    // rephrased. Every other error of ours passes through as it is.
    const rephrase =
      (waitedMs !== undefined && err.code !== 'lock_service') ||
      (err.code === 'command_timeout' && connection !== undefined);
    if (!rephrase) return err;
  }
  const why = describeFailure(connection ?? err);
  const waited = waitedMs === undefined ? '' : ` (retried for waitMs = ${waitedMs} ms)`;
  return new LockServiceError(kind, `the ${kind} lock service is unreachable${waited}: ${why}`, err);
}

function describeFailure(err: unknown): string {
  for (let e: unknown = err, depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    const message = e instanceof Error ? e.message : String(e);
    if (code === 'ECONNREFUSED' || /ECONNREFUSED/.test(message)) {
      const address = /ECONNREFUSED ([^\s]+)/.exec(message)?.[1];
      return `connection refused${address ? ` at ${address}` : ''} — is the server running, and does the URL point at it?`;
    }
    if (/Stream isn't writeable/.test(message)) {
      return 'the client is not connected (ioredis with enableOfflineQueue: false sends nothing until the connection is ready)';
    }
  }
  if (err instanceof AttemptCutShort) return 'no answer before the wait ended';
  return err instanceof Error ? err.message : String(err);
}
