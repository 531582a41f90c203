import type { Fence } from './fence.js';

/** What `inspect` says about a held lock. */
export interface LockInfo {
  readonly name: string;
  /** The holder label given at acquire, or `null`. */
  readonly holder: string | null;
  readonly fence: Fence;
  /** When the lease was granted, by the server's clock (`null` where the backend does not record it). */
  readonly acquiredAt: Date | null;
  /** Time to live left, by the server's clock (`null` where the lock has no TTL, e.g. advisory locks). */
  readonly remainingMs: number | null;
}

/** A grant from a backend: the fence, and optionally a signal the backend aborts when it knows the lease is gone. */
export interface Grant {
  readonly fence: Fence;
  readonly lost?: AbortSignal;
  /**
   * Which fence counter issued `fence` (see `LockIdentity.source`): the same
   * string for every grant whose fences are comparable. With
   * {@link LockBackend.namespace} it gives the lease its `lock`, which
   * lock-scoped writes need; a backend that leaves it out gives leases
   * without one (row scope only).
   */
  readonly source?: string;
  /**
   * Only on a grant a release handed over (`waitForRelease`): the lock is
   * held for at most this long from the waiter's last grant call unless
   * {@link LockBackend.confirm} makes it the waiter's own.
   */
  readonly confirmWithinMs?: number;
}

/** How a grant is asked for. */
export interface GrantOptions {
  /**
   * `true` when the caller is a waiting `acquire` that will retry with the
   * same token: a backend with a fair order queues the token (and keeps its
   * place while the caller keeps retrying). `false` or absent: a one-off
   * attempt (`tryAcquire`) that must not queue. Backends without a queue
   * ignore it.
   */
  readonly waiting?: boolean;
  /**
   * The most this attempt may wait *inside the backend* (for a database
   * lock), in ms: what is left of the acquire's `waitMs` (0 for
   * `tryAcquire`). A backend whose grant can block on the server enforces it
   * there (Postgres: `lock_timeout`), so a grant the caller gave up on cannot
   * land later. Absent: 0.
   */
  readonly waitMs?: number;
  /**
   * Run through it work that the service's answer asked for before it can
   * grant (Redis: a fence counter that needs a new epoch). Its time is not
   * counted in the acquire's `waitMs`, and the attempt is not cut short while
   * it runs, so a slow step of it is not reported as an unreachable
   * service; the backend must bound that work itself. The acquire's `signal`
   * still ends the attempt: then this rejects (at once, or when the work in
   * progress ends) and the backend should stop. Only before the grant that
   * takes the lock: the lease's expiry counts from the end of the last pause.
   */
  readonly recovering?: <R>(work: () => Promise<R>) => Promise<R>;
}

/**
 * The few primitives a lock backend provides; {@link createLockManager}
 * builds waiting, leases, watchdogs and events on top. Each method is one
 * round trip and is only called with validated input. Names are already
 * normalised; tokens are random and unique per acquire call (a waiting
 * acquire re-sends the same token at every attempt that got an answer; after
 * one that failed it releases and leaves with that token, in the background,
 * and goes on with a new one). A backend need not give back what a failed
 * grant may have taken: the manager does.
 */
export interface LockBackend {
  /** Short name for messages and events: `redis`, `postgres`, `advisory`. */
  readonly kind: string;
  /** The namespace the backend's locks live in; with {@link Grant.source}, part of each lease's `lock`. */
  readonly namespace?: string;
  /**
   * Grants the lock to `token` if it is free or expired, issuing a fence
   * above every fence this namespace issued before, atomically with the
   * grant. Returns `null` if someone else holds it. Must be idempotent per
   * token: a re-sent grant for a token that already holds the lock returns
   * the same fence.
   */
  grant(
    name: string,
    token: string,
    ttlMs: number,
    holder: string | null,
    options?: GrantOptions,
  ): Promise<Grant | null>;
  /**
   * Optional: a waiting acquire of `token` gave up (timeout, abort, error);
   * drop its place in the backend's queue, if any. Best effort: a backend
   * with a queue must also forget waiters that stop retrying.
   */
  leave?(name: string, token: string): Promise<void>;
  /** Resets the TTL if `token` still holds the lock; false if it does not. */
  extend(name: string, token: string, ttlMs: number): Promise<boolean>;
  /** Frees the lock if `token` still holds it; false if it did not (it was lost). Never touches another holder's lock. */
  release(name: string, token: string): Promise<boolean>;
  inspect(name: string): Promise<LockInfo | null>;
  /**
   * Resolves when the lock may have been released (a notification) or after
   * `ms`, whichever is first, or when `signal` aborts. Never rejects.
   * `token`: the waiting acquire's token; a backend with a queue may then
   * wake only the waiter whose turn it is (the others retry at `ms`).
   */
  waitForRelease(name: string, ms: number, signal: AbortSignal | undefined, token?: string): Promise<void>;
  /**
   * Optional, for a backend whose release hands the lock over to the head of
   * its queue: {@link waitForRelease} for a waiting acquire's `token`, which
   * resolves with the grant (its `confirmWithinMs` set) when the lock was
   * handed over to that token, else with `undefined`. Never rejects.
   */
  waitForTurn?(name: string, ms: number, signal: AbortSignal | undefined, token: string): Promise<Grant | undefined>;
  /**
   * With {@link waitForTurn}: makes a lock handed over to `token` its own,
   * with the caller's TTL and holder. True if `token` still held it with `fence`.
   */
  confirm?(name: string, token: string, ttlMs: number, holder: string | null, fence: Fence): Promise<boolean>;
  /** Frees what the backend holds (subscriptions, reserved connections). Not the caller's clients. */
  close(): Promise<void>;
}

/**
 * @internal `backend` as it is, declaring `namespace`: the base of a wrapper
 * that changes what grants carry (a fence source, an eager claim) and
 * forwards everything else.
 */
export function forwardTo(backend: LockBackend, namespace: string): LockBackend {
  return {
    kind: backend.kind,
    namespace,
    grant: backend.grant.bind(backend),
    ...(backend.leave ? { leave: backend.leave.bind(backend) } : {}),
    ...(backend.waitForTurn ? { waitForTurn: backend.waitForTurn.bind(backend) } : {}),
    ...(backend.confirm ? { confirm: backend.confirm.bind(backend) } : {}),
    extend: backend.extend.bind(backend),
    release: backend.release.bind(backend),
    inspect: backend.inspect.bind(backend),
    waitForRelease: backend.waitForRelease.bind(backend),
    close: backend.close.bind(backend),
  };
}
