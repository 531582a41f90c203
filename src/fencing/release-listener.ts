/**
 * Waking waiters early when a lock is released, for every backend that can
 * be told (Redis pub/sub, Postgres LISTEN/NOTIFY); plus what the two Postgres
 * backends share: their NOTIFY channel.
 */
/** The channel both Postgres backends NOTIFY on release; the payload is `namespace:name`. */
export const RELEASE_CHANNEL = 'palisade_release';

/**
 * @internal The NOTIFY payload for a release. Notifications are only hints
 * (a waiter re-tries the grant), so the rare ambiguity of a `:` inside the
 * namespace costs at most a spurious wake-up.
 */
export function releasePayload(namespace: string, name: string): string {
  return `${namespace}:${name}`;
}

/**
 * @internal Opens a subscription and resolves to its unlisten function; when
 * `closing` aborts before it is open, it gives up (rejects) instead of waiting.
 */
type Subscribe = (
  onPayload: (payload: string, prefix?: string, value?: unknown) => void,
  closing: AbortSignal,
) => Promise<() => Promise<void>>;

/**
 * @internal One subscription per lock manager (a LISTEN, a Redis SUBSCRIBE),
 * opened at the first wait, shared by all waiters, closed by
 * {@link ReleaseListener.close}. If it cannot be opened (no client given, a
 * transaction, a pooler that forbids LISTEN, Redis away), waits are plain
 * timeouts: waiting still works, by polling.
 */
export class ReleaseListener {
  readonly #subscribe: Subscribe | undefined;
  // Aborted by close(): a subscription still being opened (a server away, an offline queue) gives up.
  readonly #closing = new AbortController();
  readonly #waiters = new Map<string, Set<(value?: unknown) => void>>();
  #opening: Promise<void> | undefined;
  #unlisten: (() => Promise<void>) | undefined;
  #closed = false;

  constructor(subscribe: Subscribe | undefined) {
    this.#subscribe = subscribe;
  }

  /**
   * Resolves on a release notification for `payload` (with the value it
   * carried for exactly this payload, if any), after `ms`, or when `signal`
   * aborts (undefined). Never rejects.
   */
  waitForValue(payload: string, ms: number, signal: AbortSignal | undefined): Promise<unknown> {
    if (signal?.aborted || !(ms > 0)) return Promise.resolve(undefined);
    // Once closed, waits are plain timeouts: a caller still acquiring must not spin.
    if (!this.#closed) this.#open();
    return new Promise<unknown>((resolve) => {
      let set = this.#waiters.get(payload);
      if (!set) {
        set = new Set();
        this.#waiters.set(payload, set);
      }
      const waiters = set;
      const done = (value?: unknown) => {
        clearTimeout(timer);
        signal?.removeEventListener('abort', abort);
        waiters.delete(done);
        if (waiters.size === 0 && this.#waiters.get(payload) === waiters) this.#waiters.delete(payload);
        resolve(value);
      };
      const abort = () => done();
      const timer = setTimeout(abort, ms);
      signal?.addEventListener('abort', abort, { once: true });
      waiters.add(done);
    });
  }

  /** {@link waitForValue} for callers that need no value (no payload of theirs carries one). */
  wait(payload: string, ms: number, signal: AbortSignal | undefined): Promise<void> {
    return this.waitForValue(payload, ms, signal) as Promise<void>;
  }

  /**
   * Hands `value` to the first waiter of `payload` in this process, as a
   * notification carrying it would; nothing if none waits. The notification
   * itself, when it arrives, then finds no waiter.
   */
  deliver(payload: string, value: unknown): void {
    this.#wake(payload, undefined, value);
  }

  /** Wakes every current waiter and stops listening; later waits only time out. Safe to call more than once. */
  async close(): Promise<void> {
    this.#closed = true;
    this.#closing.abort();
    for (const set of [...this.#waiters.values()]) for (const done of [...set]) done();
    await this.#opening;
    const unlisten = this.#unlisten;
    this.#unlisten = undefined;
    await unlisten?.().catch(() => {});
  }

  #open(): void {
    if (this.#opening || !this.#subscribe) return;
    this.#opening = this.#subscribe(
      (payload, prefix, value) => this.#wake(payload, prefix, value),
      this.#closing.signal,
    ).then(
      async (unlisten) => {
        if (this.#closed) await unlisten().catch(() => {});
        else this.#unlisten = unlisten;
      },
      () => {
        // No notifications: waits fall back to their timeouts (polling).
      },
    );
  }

  /**
   * Wakes the waiters of `payload` (with `value`: one waiter only, the first
   * in), and with `prefix` also those of every payload that starts with it.
   */
  #wake(payload: string, prefix?: string, value?: unknown): void {
    const set = this.#waiters.get(payload);
    if (set) {
      if (value === undefined) for (const done of [...set]) done();
      else set.values().next().value?.(value);
    }
    if (prefix === undefined) return;
    for (const [key, waiters] of [...this.#waiters]) {
      if (key.startsWith(prefix)) for (const done of [...waiters]) done();
    }
  }
}
