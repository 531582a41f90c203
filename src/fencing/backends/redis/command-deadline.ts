/**
 * The upper bound on every Redis command and Postgres statement of the Redis
 * backend (`commandTimeoutMs`), whatever the client's own timeout: with
 * resend off a pending ioredis command may never settle.
 */
import { CommandTimeoutError } from '../../../errors.js';

/** @internal Runs a command and rejects with {@link CommandTimeoutError} if it has not settled after the bound. */
export type Bounded = <T>(what: string, run: () => Promise<T>) => Promise<T>;

/** @internal A {@link Bounded} with `timeoutMs`. */
export function commandDeadline(timeoutMs: number): Bounded {
  return function bounded<T>(what: string, run: () => Promise<T>): Promise<T> {
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new CommandTimeoutError(what, timeoutMs)), timeoutMs);
    });
    // run() starts inside the chain, so even a synchronous throw settles it and clears the timer.
    return Promise.race([Promise.resolve().then(run), timeout]).finally(() => clearTimeout(timer));
  };
}
