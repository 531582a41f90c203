/**
 * The upper bound on every Redis command and Postgres statement of the Redis
 * backend (`commandTimeoutMs`), whatever the client's own timeout: with
 * resend off a pending ioredis command may never settle.
 *
 * Every command of a backend gets the same bound, so their deadlines fall
 * in the order they were sent: one timer, armed for the oldest pending
 * command, serves them all (a timer per command cost a `setTimeout`, a
 * `clearTimeout` and a `Promise.race` per round trip).
 */
import { performance } from 'node:perf_hooks';
import { CommandTimeoutError } from '../../../errors.js';

/**
 * @internal Runs a command and rejects with {@link CommandTimeoutError} if it has not settled after
 * the bound. `run` gets `expired()`: true once that rejection happened (nobody waits for the rest).
 */
export type Bounded = <T>(what: string, run: (expired: () => boolean) => Promise<T>) => Promise<T>;

interface Pending {
  readonly at: number;
  readonly what: string;
  readonly reject: (err: unknown) => void;
  settled: boolean;
}

/** @internal A {@link Bounded} with `timeoutMs`. */
export function commandDeadline(timeoutMs: number): Bounded {
  // Oldest first; settled entries stay until the timer or a later push passes them.
  const pending: Pending[] = [];
  let head = 0;
  let timer: NodeJS.Timeout | undefined;
  let open = 0;

  function dropSettled(): void {
    while (head < pending.length && (pending[head] as Pending).settled) head++;
    if (head === pending.length) {
      pending.length = 0;
      head = 0;
    } else if (head > 1024 && head * 2 > pending.length) {
      pending.splice(0, head);
      head = 0;
    }
  }

  function expire(): void {
    timer = undefined;
    const now = performance.now();
    dropSettled();
    while (head < pending.length) {
      const entry = pending[head] as Pending;
      if (!entry.settled) {
        if (entry.at > now) break;
        entry.settled = true;
        open--;
        entry.reject(new CommandTimeoutError(entry.what, timeoutMs));
      }
      head++;
    }
    dropSettled();
    arm();
  }

  function arm(): void {
    if (timer !== undefined) {
      if (open > 0) timer.ref();
      return;
    }
    if (head >= pending.length) return;
    const first = pending[head] as Pending;
    timer = setTimeout(expire, Math.max(0, first.at - performance.now()) + 1);
  }

  function settle(entry: Pending): boolean {
    if (entry.settled) return false;
    entry.settled = true;
    // Nothing left to watch: the timer stays armed (re-arming it per command is what this module
    // saves) but no longer keeps the process alive.
    if (--open === 0) {
      timer?.unref();
      pending.length = 0;
      head = 0;
    }
    return true;
  }

  return function bounded<T>(what: string, run: (expired: () => boolean) => Promise<T>): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const entry: Pending = { at: performance.now() + timeoutMs, what, reject, settled: false };
      pending.push(entry);
      open++;
      arm();
      let work: Promise<T>;
      try {
        // Settled before `run` settles only by the timeout.
        work = run(() => entry.settled);
      } catch (err) {
        if (settle(entry)) reject(err);
        return;
      }
      work.then(
        (value) => {
          if (settle(entry)) resolve(value);
        },
        (err: unknown) => {
          if (settle(entry)) reject(err);
        },
      );
    });
  };
}
