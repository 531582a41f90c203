import { performance } from 'node:perf_hooks';
import { InvalidArgumentError, LockUnavailableError } from '../errors.js';
import { observeAcquire } from '../telemetry/locks.js';
import { AttemptCutShort, bounded, isUnreachable, serviceError, stepOf } from './attempt.js';
import type { Grant, LockBackend, LockInfo } from './backend.js';
import { Emitter, type LockEvents } from './events.js';
import type { Fence } from './fence.js';
import { ActiveLease, type Lease } from './lease.js';
import { type AcquireOptions, type CheckedOptions, checkLockName, checkOptions } from './options.js';
import { newToken } from './token.js';

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
   * keeps this caller's place in line across its retries — except after an
   * attempt that failed (no answer): what it may have taken is given back,
   * and the wait goes on with a new token at the end of the line.
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
   * nothing: on failure the ones taken are released, in the background (the
   * call rejects at once). `waitMs` bounds the whole call, and `signal`
   * ends it at once.
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
  /**
   * For a backend with a fair queue that hands the lock over (Redis): after
   * its first attempt a waiting acquire retries every `min`–`max` ms (jitter)
   * instead of backing off from 5 ms — its turn comes by a handoff, a retry
   * only keeps its place. `max` must stay below the backend's staleness bound.
   */
  readonly queuedRetryMs?: { readonly min: number; readonly max: number };
}

/**
 * Builds a {@link LockManager} from a backend's primitives: validation,
 * bounded waiting, leases with local deadlines and watchdogs, events.
 */
export function createLockManager(backend: LockBackend, hooks: LockManagerHooks = {}): LockManager {
  const events = new Emitter<LockEvents>();

  // No event object is built while nobody listens (the acquire hot path).
  const announce = (name: string, fence: Fence, holder: string | null, startedAt: number): void => {
    if (events.listens('acquired')) {
      events.emit('acquired', { name, fence, holder, waitedMs: performance.now() - startedAt });
    }
  };

  async function attempt(
    name: string,
    opts: CheckedOptions,
    startedAt: number,
    token: string,
    waiting: boolean,
    deadline: number,
    cutAt = Number.POSITIVE_INFINITY,
    onPaused?: (ms: number) => void,
  ): Promise<Lease | null> {
    let sentAt = performance.now();
    // The backend bounds its own server-side wait by what is left of waitMs (Postgres: lock_timeout).
    const waitMs = Math.max(0, deadline - sentAt);
    // The grant that lands after the service's own work was sent after it: the lease's expiry counts from there.
    const resent = (ms: number) => {
      sentAt = performance.now();
      onPaused?.(ms);
    };
    const grant = await bounded(
      (recovering) => backend.grant(name, token, opts.ttlMs, opts.holder, { waiting, waitMs, recovering }),
      cutAt,
      // A grant that lands after we gave up — or fails then, when it may have taken the lock with its
      // reply lost — is given back at once rather than left for its TTL. (The give-back the cut-off sent
      // can reach the service first: a pool of connections does not keep their order.)
      (late) => {
        if (late !== null) backend.release(name, token).catch(() => {});
      },
      opts.signal,
      resent,
    );
    return grant ? leaseOf(name, opts, startedAt, token, grant, sentAt) : null;
  }

  // The lease of a grant sent at `sentAt` (its local expiry counts from then), announced.
  function leaseOf(
    name: string,
    opts: CheckedOptions,
    startedAt: number,
    token: string,
    grant: Grant,
    sentAt: number,
    confirm?: { readonly withinMs: number; run(): Promise<boolean> },
  ): Lease {
    const lease = new ActiveLease({
      backend,
      events,
      name,
      token,
      fence: grant.fence,
      lock: lockOf(grant, name),
      holder: opts.holder,
      ttlMs: opts.ttlMs,
      sentAt,
      backendLost: grant.lost,
      autoExtend: opts.autoExtend,
      maxHoldMs: opts.maxHoldMs,
      ...(confirm ? { confirm } : {}),
    });
    announce(name, grant.fence, opts.holder, startedAt);
    return lease;
  }

  // The lease's lock identity for lock-scoped writes: only where the backend names its source.
  const lockOf = (grant: Grant, name: string) =>
    grant.source === undefined || backend.namespace === undefined
      ? undefined
      : Object.freeze({ kind: backend.kind, source: grant.source, namespace: backend.namespace, name });

  // A grant a release handed over: the lease starts now, held until the end of the confirmation
  // window counted from our last send; the confirmation (deferred by the lease, skipped when it is
  // released first) gives it the full TTL.
  function handedOver(
    name: string,
    opts: CheckedOptions,
    startedAt: number,
    token: string,
    grant: Grant,
    lastSentAt: number,
  ): Lease {
    const confirm = backend.confirm as NonNullable<LockBackend['confirm']>;
    return leaseOf(name, opts, startedAt, token, grant, lastSentAt, {
      withinMs: grant.confirmWithinMs ?? 0,
      run: () => confirm(name, token, opts.ttlMs, opts.holder, grant.fence),
    });
  }

  // An attempt that failed (an error, not an answer) may still have taken the lock — its reply
  // lost, or the grant still queued in the client. Its lock and its place in line are given back in
  // the background, and its token is never sent again: a later attempt with the same token could
  // take the lock before that release lands, and the release would then free the new lease's lock.
  const giveBack = (name: string, token: string): void => {
    backend.release(name, token).catch(() => {});
    backend.leave?.(name, token).catch(() => {});
  };

  // Bound once, not per wait of every waiting acquire.
  const waitForTurn = backend.waitForTurn?.bind(backend);

  // One token across the attempts that get an answer: a backend with a fair order keeps the token's
  // place in its queue. After an attempt that failed, a new token (see giveBack).
  // `wait.until`: the wait's deadline. Work the service asked for (a new Redis epoch) is not counted
  // in waitMs: it moves the deadline later, for every name of an acquireAll (they share `wait`).
  async function acquireUntil(name: string, opts: CheckedOptions, wait: { until: number }): Promise<Lease> {
    const startedAt = performance.now();
    const paused = (ms: number) => {
      wait.until += ms;
    };
    let token = newToken();
    let queued = false;
    let unreachable: unknown;
    let answered = false;
    let lastSentAt = startedAt;
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
              ? Math.max(wait.until + (hooks.waitGraceMs ?? 0), performance.now() + MIN_ATTEMPT_MS)
              : Infinity;
          lastSentAt = performance.now();
          lease = await attempt(name, opts, startedAt, token, true, wait.until, cutAt, paused);
          unreachable = undefined;
          answered = true;
        } catch (err) {
          const step = err instanceof AttemptCutShort ? stepOf(token) : undefined;
          giveBack(name, token);
          token = newToken();
          // Aborted while the service's own work ran (the attempt ends at once then): the caller gave up.
          if (opts.signal?.aborted) throw new LockUnavailableError(name, 'aborted');
          // The service may come back (a restart, a connection not up yet): retry within the wait.
          if (!isUnreachable(err, hooks)) throw serviceError(hooks, backend.kind, err);
          unreachable = step === undefined ? err : new AttemptCutShort(step);
        }
        if (lease) {
          queued = false;
          return lease;
        }
        // The wait is over: a timeout, or the outage its last attempt met. A last attempt cut short after
        // others were answered is a plain timeout, not an outage.
        const waitEnded = () => {
          const outage = unreachable !== undefined && !(answered && unreachable instanceof AttemptCutShort);
          return outage
            ? serviceError(hooks, backend.kind, unreachable, opts.waitMs)
            : new LockUnavailableError(name, 'timeout');
        };
        const left = wait.until - performance.now();
        if (left <= 0) throw waitEnded();
        // Full jitter spreads retries (and, in a queue, refreshes our place);
        // a release notification cuts the wait short.
        const queuedRetry = hooks.queuedRetryMs;
        const backoff = queuedRetry
          ? queuedRetry.min + Math.random() * (queuedRetry.max - queuedRetry.min)
          : Math.random() * Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** Math.min(tries, 16));
        if (waitForTurn && backend.confirm) {
          let handed: Grant | undefined;
          let cut = false;
          try {
            // Cut soon after the wait's end, and at the signal's abort, as an attempt is: what a handover does
            // besides waiting (an eager claim on a database that stopped answering) kept a waiter up to its
            // timeout past waitMs, and an aborted one until it answered — then with the lease. Not at the end
            // itself, where a plain wait for a turn ends too.
            handed = await bounded(
              () => waitForTurn(name, Math.min(left, backoff), opts.signal, token),
              Math.max(wait.until + (hooks.waitGraceMs ?? 0), performance.now()) + MIN_ATTEMPT_MS,
              (late) => {
                if (late) backend.release(name, token).catch(() => {});
              },
              opts.signal,
            );
          } catch (err) {
            if (!(err instanceof AttemptCutShort)) throw err;
            cut = true;
          }
          if (cut || (handed && opts.signal?.aborted)) {
            queued = false;
            giveBack(name, token);
            throw opts.signal?.aborted ? new LockUnavailableError(name, 'aborted') : waitEnded();
          }
          // The lock was handed over to us: our wake-up is our grant, unless its confirmation window
          // (counted from our last grant call, sent before the release) is as good as over.
          if (handed && performance.now() < lastSentAt + (handed.confirmWithinMs ?? 0) / 2) {
            queued = false;
            return handedOver(name, opts, startedAt, token, handed, lastSentAt);
          }
        } else {
          await backend.waitForRelease(name, Math.min(left, backoff), opts.signal, token);
        }
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
      const wait = { until: performance.now() + opts.waitMs };
      return observeAcquire(backend.kind, checked, () => acquireUntil(checked, opts, wait));
    },

    async tryAcquire(name, options) {
      const checked = checkLockName(name);
      const opts = checkOptions(options, 0);
      const now = performance.now();
      const token = newToken();
      return observeAcquire(backend.kind, checked, async () => {
        try {
          return await attempt(checked, opts, now, token, false, now);
        } catch (err) {
          giveBack(checked, token);
          if (opts.signal?.aborted) throw new LockUnavailableError(checked, 'aborted');
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
      const wait = { until: performance.now() + opts.waitMs };
      const held: Lease[] = [];
      try {
        for (const name of sorted)
          held.push(await observeAcquire(backend.kind, name, () => acquireUntil(name, opts, wait)));
        return held;
      } catch (err) {
        // In the background: releases through a service that stopped answering held the call past its
        // abort and past waitMs, up to the command timeout (an attack). release() never rejects.
        for (const lease of held) void lease.release();
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
