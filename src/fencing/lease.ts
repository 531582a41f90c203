import { performance } from 'node:perf_hooks';
import { LeaseLostError } from '../errors.js';
import type { LostReason } from '../telemetry/catalog.js';
import { observeExtend, observeRelease, recordLost } from '../telemetry/locks.js';
import type { LockBackend } from './backend.js';
import { atDeadline, cancelDeadline, type Deadline } from './deadlines.js';
import type { Emitter, LockEvents } from './events.js';
import type { Fence } from './fence.js';
import type { LockIdentity } from './lock-identity.js';
import { checkTtl } from './options.js';

/**
 * A granted lock. Holding a lease means "you may write" only until it
 * expires — which can happen while you are paused. Writes must carry
 * `fence` to a resource that checks it; `signal` only tells you early.
 */
export interface Lease {
  readonly name: string;
  /** Random, 128 bits, unique to this grant: release and extend are checked against it. */
  readonly token: string;
  readonly fence: Fence;
  /**
   * The lock this lease was granted for, as its fence register is keyed
   * (backend kind, fence source, namespace, name): what makes
   * `repo.with(lease)` lock-scoped (README, "Two scopes of fencing"). Every
   * built-in backend sets it; `undefined` only for a user backend whose
   * grants carry no `source`.
   */
  readonly lock: LockIdentity | undefined;
  readonly holder: string | null;
  /**
   * Aborted (with a `LeaseLostError`) when the lease is known or presumed
   * lost: an extension found it gone or failed, the local monotonic deadline
   * passed without a confirmed extension, the backend saw it drop — or it
   * was released.
   */
  readonly signal: AbortSignal;
  /** Estimate of the expiry on this process's monotonic clock (`performance.now()` ms); the server decides. */
  readonly expiresAt: number;
  /**
   * Resets the TTL (default: the acquire TTL) if this token still holds the
   * lock. Never re-acquires a lost lease. A shorter TTL lowers `expiresAt`
   * as it is sent (the server may apply it before its reply arrives); only
   * the reply of the last extension sent sets it again.
   * @throws {LeaseLostError} if the lease is gone (the signal is aborted too).
   */
  extend(ttlMs?: number): Promise<void>;
  /**
   * Stops the watchdog and frees the lock if this token still holds it.
   * Returns `'lost'` (touching nothing) if another holder has it or it
   * expired — and also when the lock service could not be reached to
   * confirm the release (Redis down, a dropped connection): the lease is
   * then presumed lost and its TTL frees the lock. Never throws the
   * client's error (a failed release is a `lost` event, reason `release failed: …`). Safe to call more than once.
   */
  release(): Promise<'released' | 'lost'>;
}

/** @internal How the lock manager hands a grant to a lease. */
export interface LeaseInit {
  readonly backend: LockBackend;
  readonly events: Emitter<LockEvents>;
  readonly name: string;
  readonly token: string;
  readonly fence: Fence;
  readonly lock: LockIdentity | undefined;
  readonly holder: string | null;
  readonly ttlMs: number;
  /** `performance.now()` just before the grant was sent: the TTL counts from no later than this. */
  readonly sentAt: number;
  readonly backendLost: AbortSignal | undefined;
  readonly autoExtend: boolean;
  readonly maxHoldMs: number | undefined;
  /**
   * A grant a release handed over: held only `withinMs` from `sentAt` until
   * `run` confirms it, then `ttlMs` from the confirmation's send. `run` is
   * sent once a quarter of what is left of that window has passed, unless the
   * lease was released or lost first: a short critical section never sends it.
   */
  readonly confirm?: { readonly withinMs: number; readonly run: () => Promise<boolean> };
}

// The errors of leases lost because their backend's connection dropped: their signal aborts from that
// connection's close (../repo/lost-lease.ts waits a turn before it sends anything then).
const dropped = new WeakSet<object>();

/** @internal Whether `reason` (a signal's) is the error of a lease lost because its backend's connection dropped. */
export const lostToDroppedConnection = (reason: unknown): boolean =>
  typeof reason === 'object' && reason !== null && dropped.has(reason);

/**
 * @internal Marks `error` as a lease's loss to its backend's dropped connection, before a signal aborts
 * with it (a lease whose backend lost its session; a test that stands in for one).
 */
export const markLostToDroppedConnection = (error: object): void => {
  dropped.add(error);
};

/** @internal */
export class ActiveLease implements Lease {
  readonly name: string;
  readonly token: string;
  readonly fence: Fence;
  readonly lock: LockIdentity | undefined;
  readonly holder: string | null;
  readonly #init: LeaseInit;
  // Created when someone reads `signal` (most leases are released without anyone looking).
  #controller: AbortController | undefined;
  #aborted = false;
  #reason: string | undefined;
  #error: LeaseLostError | undefined;
  #expiresAt: number;
  #deadline: Deadline | undefined;
  #confirmAt: Deadline | undefined;
  #watchdog: NodeJS.Timeout | undefined;
  #released: Promise<'released' | 'lost'> | undefined;
  #onBackendLost: (() => void) | undefined;
  // Extensions sent so far. Redis applies a client's commands in the order sent, so only the reply of
  // the last one sent may set the estimate (the confirmation only lengthens; it never shortens one).
  // Elsewhere (a pool, gRPC) two extensions in flight at once may be applied in either order.
  #extends = 0;

  constructor(init: LeaseInit) {
    this.#init = init;
    this.name = init.name;
    this.token = init.token;
    this.fence = init.fence;
    this.lock = init.lock;
    this.holder = init.holder;
    this.#expiresAt = init.sentAt + (init.confirm ? Math.min(init.confirm.withinMs, init.ttlMs) : init.ttlMs);
    this.#armDeadline();
    if (init.confirm) {
      // Deferred, so that a critical section shorter than this spends no command on it; what is left
      // (at least 3/4 of the rest of the window) bounds the confirmation's own round trip.
      const run = init.confirm.run;
      const at = performance.now() + Math.max(0, this.#expiresAt - performance.now()) / 4;
      this.#confirmAt = atDeadline(at, () => {
        this.#confirmAt = undefined;
        if (!this.#aborted) this.#confirm(run);
      });
    }
    if (init.backendLost) {
      this.#onBackendLost = () => this.#lose('the backend lost the lock (connection dropped)', 'connection_dropped');
      if (init.backendLost.aborted) this.#onBackendLost();
      else init.backendLost.addEventListener('abort', this.#onBackendLost, { once: true });
    }
    if (init.autoExtend) this.#startWatchdog();
  }

  #confirm(run: () => Promise<boolean>): void {
    const sentAt = performance.now();
    const extendsBefore = this.#extends;
    run().then(
      (held) => {
        if (this.#aborted) return;
        if (!held) {
          this.#lose('the lock handed over by a release was gone before it was confirmed', 'extension_refused');
          return;
        }
        // The confirmation only lengthens the TTL; an extension sent after it decides (its reply sets the estimate).
        if (this.#extends !== extendsBefore) return;
        this.#expiresAt = Math.max(this.#expiresAt, sentAt + this.#init.ttlMs);
        this.#armDeadline();
      },
      (err: unknown) =>
        this.#lose(
          `the confirmation of a lock handed over failed: ${err instanceof Error ? err.message : String(err)}`,
          'extension_failed',
        ),
    );
  }

  get signal(): AbortSignal {
    if (!this.#controller) {
      this.#controller = new AbortController();
      if (this.#aborted) this.#controller.abort(this.#lostError());
    }
    return this.#controller.signal;
  }

  get expiresAt(): number {
    return this.#expiresAt;
  }

  extend(ttlMs?: number): Promise<void> {
    return observeExtend(this.#init.backend.kind, this.name, this.fence, () => this.#extend(ttlMs));
  }

  async #extend(ttlMs?: number): Promise<void> {
    const ttl = ttlMs === undefined ? this.#init.ttlMs : checkTtl(ttlMs);
    if (this.#aborted) throw this.#lostError();
    const sentAt = performance.now();
    const send = ++this.#extends;
    // The server may apply a shorter TTL long before its reply arrives: the estimate drops as it is sent.
    if (sentAt + ttl < this.#expiresAt) {
      this.#expiresAt = sentAt + ttl;
      this.#armDeadline();
    }
    let held: boolean;
    try {
      held = await this.#init.backend.extend(this.name, this.token, ttl);
    } catch (err) {
      // An unconfirmed extension is presumed lost: we cannot know the TTL was reset.
      this.#lose(`extension failed: ${err instanceof Error ? err.message : String(err)}`, 'extension_failed');
      throw this.#lostError();
    }
    if (!held) {
      this.#lose('an extension found the lock held by someone else or expired', 'extension_refused');
      throw this.#lostError();
    }
    if (this.#aborted) throw this.#lostError();
    // An extension sent after this one was applied after it: until its reply, this one only lowers.
    this.#expiresAt = send === this.#extends ? sentAt + ttl : Math.min(this.#expiresAt, sentAt + ttl);
    this.#armDeadline();
    if (this.#init.events.listens('extended')) {
      this.#init.events.emit('extended', { name: this.name, fence: this.fence, ttlMs: ttl });
    }
  }

  release(): Promise<'released' | 'lost'> {
    const { backend, sentAt } = this.#init;
    this.#released ??= observeRelease(backend.kind, this.name, this.fence, sentAt, () => this.#release());
    return this.#released;
  }

  async #release(): Promise<'released' | 'lost'> {
    const wasLost = this.#aborted;
    this.#stopTimers();
    let held = false;
    let failed: unknown;
    try {
      held = await this.#init.backend.release(this.name, this.token);
    } catch (err) {
      // Unconfirmed: presumed lost (the TTL frees it); the caller's fenced writes are refused either way.
      failed = err;
    } finally {
      // An extension in flight when release began may have re-armed the deadline or the watchdog meanwhile.
      this.#stopTimers();
      this.#abort('released');
      if (this.#init.events.listens('released')) {
        this.#init.events.emit('released', { name: this.name, fence: this.fence, wasHeld: held && !wasLost });
      }
    }
    if (failed !== undefined && !wasLost) {
      // Not thrown (the work under the lock is done), but not silent either: watchers of 'lost' see it.
      const why = failed instanceof Error ? failed.message : String(failed);
      this.#init.events.emit('lost', { name: this.name, fence: this.fence, reason: `release failed: ${why}` });
    }
    return held ? 'released' : 'lost';
  }

  #armDeadline(): void {
    cancelDeadline(this.#deadline);
    this.#deadline = atDeadline(this.#expiresAt, () =>
      this.#lose('the TTL ran out without a confirmed extension', 'ttl_expired'),
    );
  }

  #startWatchdog(): void {
    const every = Math.max(1, Math.floor(this.#init.ttlMs / 3));
    const stopAt =
      this.#init.maxHoldMs === undefined ? Number.POSITIVE_INFINITY : performance.now() + this.#init.maxHoldMs;
    const tick = async () => {
      if (this.#aborted || performance.now() >= stopAt) return;
      try {
        await this.extend();
      } catch {
        return; // extend() has aborted the signal; never re-acquire.
      }
      if (!this.#aborted) this.#watchdog = setTimeout(tick, every).unref();
    };
    this.#watchdog = setTimeout(tick, every).unref();
  }

  #lose(reason: string, code: LostReason): void {
    if (this.#aborted) return;
    recordLost(this.#init.backend.kind, this.name, this.fence, code);
    this.#stopTimers();
    this.#abort(reason, code === 'connection_dropped');
    this.#init.events.emit('lost', { name: this.name, fence: this.fence, reason });
  }

  #abort(reason: string, connectionDropped = false): void {
    if (this.#aborted) return;
    this.#aborted = true;
    this.#reason = reason;
    // A loss keeps the stack of where it was found; a release builds its error only if someone looks.
    if (reason !== 'released') this.#lostError();
    // Marked before the signal aborts: its listeners ask.
    if (connectionDropped) markLostToDroppedConnection(this.#lostError());
    this.#controller?.abort(this.#lostError());
  }

  #lostError(): LeaseLostError {
    if (this.#error) return this.#error;
    // A release's error skips the stack trace: captured under the deep async stack of a Redis reply
    // it cost ~30 µs of client CPU per release (measured by bench/sections/lock-round-trips.ts), and it would only point here.
    const reason = this.#reason ?? 'released';
    const limit = Error.stackTraceLimit;
    if (reason === 'released') Error.stackTraceLimit = 0;
    try {
      this.#error = new LeaseLostError(this.name, this.fence, reason);
    } finally {
      Error.stackTraceLimit = limit;
    }
    return this.#error;
  }

  #stopTimers(): void {
    cancelDeadline(this.#deadline);
    cancelDeadline(this.#confirmAt);
    clearTimeout(this.#watchdog);
    if (this.#onBackendLost) this.#init.backendLost?.removeEventListener('abort', this.#onBackendLost);
  }
}
