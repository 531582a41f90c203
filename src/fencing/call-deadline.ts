/**
 * A client-side bound on one call of a backend whose server bounds only its
 * lock waits (the Postgres backends, `commandTimeoutMs`): a connection that
 * stops answering — a frozen host, a stuck proxy — would otherwise leave the
 * call pending until the kernel gives up on the socket, or for ever.
 */
import { performance } from 'node:perf_hooks';
import { CommandTimeoutError } from '../errors.js';
import { sqlStateOf } from '../server-error.js';
import { atDeadline, cancelDeadline } from './deadlines.js';
import { SERVER_WAIT_GRACE_MS } from './options.js';

/**
 * @internal Runs `run` and rejects with {@link CommandTimeoutError} if it
 * has not settled within `ms`. The work goes on where it is (a statement
 * already sent may still run): `abandoned` aborts at the deadline, so `run`
 * can stop before its next step. What it settles with afterwards goes to
 * `onLate`: its value, or `undefined` when it failed (a grant that lands
 * late — or fails then, when it may have taken the lock with its reply
 * lost — is given back from there, after it settled: the lock manager's
 * own give-back, sent at once, may reach the server before the grant does,
 * on another connection). The late failure itself reaches nobody.
 */
export function withinMs<T>(
  what: string,
  ms: number,
  run: (abandoned: AbortSignal) => Promise<T>,
  onLate?: (value: T | undefined) => void,
): Promise<T> {
  const abandoned = new AbortController();
  return new Promise<T>((resolve, reject) => {
    const deadline = atDeadline(performance.now() + ms, () => {
      abandoned.abort();
      reject(new CommandTimeoutError(what, ms));
    });
    let work: Promise<T>;
    try {
      work = run(abandoned.signal);
    } catch (err) {
      cancelDeadline(deadline);
      reject(err);
      return;
    }
    work.then(
      (value) => {
        if (abandoned.signal.aborted) return onLate?.(value);
        cancelDeadline(deadline);
        resolve(value);
      },
      (err: unknown) => {
        if (abandoned.signal.aborted) return onLate?.(undefined);
        cancelDeadline(deadline);
        reject(err);
      },
    );
  });
}

/**
 * @internal A fresh Postgres manager's one-time checks before its first
 * grant (`checks(wait)`: the fence sequence, the source id), shared with
 * concurrent first grants that may wait longer. This grant waits for them at
 * most its own wait plus the grace every grant gets past it (their round
 * trips: a bound of the wait alone made a fresh manager's `tryAcquire`
 * answer "not granted" on a free lock under load). `false` when they
 * outlasted that, or an operator's lock outlasted the wait on the server
 * (55P03): the grant is then "not granted".
 */
export async function firstGrantChecks(
  what: string,
  wait: number,
  checks: (wait: number) => Promise<unknown>,
): Promise<boolean> {
  try {
    await withinMs(what, wait + SERVER_WAIT_GRACE_MS, () => checks(wait));
    return true;
  } catch (err) {
    if (sqlStateOf(err) === '55P03' || err instanceof CommandTimeoutError) return false;
    throw err;
  }
}
