/**
 * Ending the session of a transaction palisade opened for a lease (a fenced
 * transaction, a lock-scoped `modify`) when the lease is lost while the
 * caller's function runs (README, "Fenced transactions"). The idle
 * timeout ends only an idle transaction; a holder busy inside one — a long
 * statement, or statements sent after its lease ran out — would otherwise
 * keep its lock's register row locked, and the lock's next holder out, for
 * as long as it stays busy. A fenced transaction's commit would fail
 * anyway, once its function returned; a `modify` whose lease is gone is
 * refused as well, rather than commit a write no lease stands behind.
 */
import { sql } from 'drizzle-orm';
import type { Database } from '../driver.js';
import { prepared } from '../prepared.js';

/**
 * Which server session runs a transaction, and which of its transactions:
 * `pg_backend_pid()` and `now()` (the transaction's start, in µs since the
 * epoch), read in the transaction's first statement.
 */
export interface SessionOf {
  readonly pid: number;
  readonly started: string;
}

/** @internal The columns a transaction's first statement adds to name its {@link SessionOf}. */
export const sessionColumnsSql = () =>
  sql`pg_backend_pid() as palisade_pid, (extract(epoch from now()) * 1000000)::int8::text as palisade_started`;

/** @internal The {@link SessionOf} a row with {@link sessionColumnsSql} names. */
export function sessionOf(row: Record<string, unknown> | undefined): SessionOf | undefined {
  const pid = Number(row?.palisade_pid);
  const started = row?.palisade_started;
  return Number.isSafeInteger(pid) && typeof started === 'string' ? { pid, started } : undefined;
}

const p = (name: string) => sql.placeholder(name);
// Only while that very transaction is open: a session whose transaction ended (the pool lent its
// connection on) has another start, or none. What it cannot rule out is a transaction that ends and
// one that starts on the same connection between this statement's read and its signal (microseconds).
const endSql = () =>
  sql`select pg_terminate_backend(a.pid) as ended from pg_stat_activity a
    where a.pid = ${p('pid')}::int4 and (extract(epoch from a.xact_start) * 1000000)::int8 = ${p('started')}::int8`;

/**
 * @internal Ends `session` from `db` (another connection of its pool) if it
 * still runs the same transaction; true when it was ended. Never throws: a
 * pool with no free connection runs it once the transaction gave its
 * connection back, where it finds nothing to end.
 */
export async function endSession(db: Database, session: SessionOf): Promise<boolean> {
  try {
    const rows = await prepared(db, 'palisade.end_session', endSql).rows({ ...session });
    return rows[0]?.ended === true;
  } catch {
    return false;
  }
}

/**
 * @internal While armed, the first abort of any of `signals` ends `session`
 * from `db`. `disarm()` stops listening (call it before the commit: a
 * session ended during COMMIT leaves its outcome unknown) and tells whether
 * the session was ended.
 */
export function endOnAbort(
  db: Database,
  session: SessionOf,
  signals: readonly AbortSignal[],
): { disarm(): Promise<boolean> | undefined } {
  let ending: Promise<boolean> | undefined;
  const onAbort = () => {
    ending ??= endSession(db, session);
  };
  for (const signal of signals) signal.addEventListener('abort', onAbort, { once: true });
  // Aborted before the listeners were there (between the claim and now).
  if (signals.some((s) => s.aborted)) onAbort();
  return {
    disarm: () => {
      for (const signal of signals) signal.removeEventListener('abort', onAbort);
      return ending;
    },
  };
}
