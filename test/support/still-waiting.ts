/**
 * How a test tells "ended at once" (on an abort, at the wait's end) from
 * "held until something else answered" without timing the call: its
 * outcome, or a marker string if it has not settled long after (bounded,
 * so a regression fails the test instead of hanging it).
 */
import { sql } from 'drizzle-orm';
import { type Database, execute } from '../../src/driver.js';

/** What `call` settled with (its value, or what it rejected with), or `still waiting after …` past `ms`. */
export async function outcomeOrStillWaiting(call: Promise<unknown>, ms = 20_000): Promise<unknown> {
  let cap: NodeJS.Timeout | undefined;
  return Promise.race([
    call.then(
      (value) => value,
      (err: unknown) => err,
    ),
    new Promise((resolve) => {
      cap = setTimeout(() => resolve(`still waiting after ${ms / 1000} s`), ms);
    }),
  ]).finally(() => clearTimeout(cap));
}

/** Polls `ready` every 10 ms, at most 3,000 times; throws if it never holds. */
export async function until(ready: () => boolean | Promise<boolean>): Promise<void> {
  for (let i = 0; i < 3_000; i++) {
    if (await ready()) return;
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
  throw new Error('the state the test waits for never came');
}

/**
 * Whether the server session `pid` waits for a lock. By its pid: other sessions of the cluster — the suite
 * runs in parallel — do not count.
 */
export const waitingForLock = async (db: Database, pid: number): Promise<boolean> =>
  (await execute(db, sql`select count(*)::int as n from pg_locks where pid = ${pid} and not granted`))[0]?.n !== 0;
