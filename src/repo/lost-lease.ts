/**
 * A transaction palisade opened for a lease (a fenced transaction, a
 * lock-scoped `modify`) whose lease is lost while the caller's function
 * runs (README, "Fenced transactions"). The idle timeout ends only an idle
 * transaction; a holder busy inside one — a long statement, or statements
 * sent after its lease ran out — would otherwise keep its lock's register
 * row locked, and the lock's next holder out, for as long as it stays busy.
 * So the transaction's statements are refused from then on, before they
 * are sent; the one the server runs is cancelled; and the transaction is
 * rolled back right after it, on its own connection — the function may go
 * on, idle or catching its errors in a savepoint, for as long as it likes.
 *
 * Cancelled, not ended: ending the session (`pg_terminate_backend`) takes
 * effect only after a rollback under way, on a connection the pool has
 * already lent on; and postgres.js hands the 57P01 of a session ended under
 * a statement to the next query on its reconnected connection.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { sql } from 'drizzle-orm';
import { nextTurn } from '../aborted-transaction.js';
import { type Database, driverOf, isTransaction, refuseStatements } from '../driver.js';
import { LeaseLostError, PalisadeError } from '../errors.js';
import type { Fence } from '../fencing/fence.js';
import { lostToDroppedConnection } from '../fencing/lease.js';
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
// Only a statement of that very transaction, while one runs. A cancel that reaches a session between
// statements (or during a rollback) is dropped once it reads its next command; what this cannot rule
// out is a transaction that ends and a statement of the next that starts between this read and its
// signal (microseconds, and a round trip of the client's in between).
const cancelSql = () =>
  sql`select case when a.state = 'active' then pg_cancel_backend(a.pid) else false end as cancelled
    from pg_stat_activity a
    where a.pid = ${p('pid')}::int4 and (extract(epoch from a.xact_start) * 1000000)::int8 = ${p('started')}::int8`;

/**
 * @internal Cancels the statement `session`'s transaction runs, if it runs
 * one: `cancelled`, `idle` (open, no statement running) or `gone` (ended).
 */
export async function cancelStatement(db: Database, session: SessionOf): Promise<'cancelled' | 'idle' | 'gone'> {
  const [row] = await prepared(db, 'palisade.cancel_statement', cancelSql).rows({ ...session });
  return row === undefined ? 'gone' : row.cancelled === true ? 'cancelled' : 'idle';
}

// How often, and how many times at most, a lost lease's transaction is looked at while the function runs:
// a statement already on its way when the refusal came may start after a look.
const LOOK_EVERY_MS = 50;
const MAX_LOOKS = 200;

/** @internal The error a lease lost while palisade worked for it comes out as: its signal's reason, if a PalisadeError. */
export function lostError(signal: AbortSignal, fence: Fence): Error {
  const reason: unknown = signal.reason;
  return reason instanceof PalisadeError ? reason : new LeaseLostError('(lease)', fence, 'its signal was aborted');
}

/** What {@link stopOnAbort} returns where nothing is armed. */
const NOT_ARMED = { disarm: () => false };

/**
 * @internal Where `db` is what a transaction palisade opens on `db` runs
 * in, nothing is armed: inside a transaction (the outermost owns the
 * session: stopping would fail the caller's own statements), and on PGlite
 * (one connection), or when the first statement named no `session`.
 *
 * While armed, the first abort of any of `signals` refuses every
 * further statement on `tx` (with `reason()`), rolls it back after the
 * statement it runs (see `refuseStatements`) and cancels, from `db` (another
 * connection of its pool), each statement `session` runs until the
 * transaction ends, `disarm()` is called or {@link MAX_LOOKS} looks passed.
 * `disarm()` (call it once the function settled) tells whether it fired.
 */
export function stopOnAbort(
  db: Database,
  tx: Database,
  session: SessionOf | undefined,
  signals: readonly AbortSignal[],
  reason: () => Error,
): { disarm(): boolean } {
  if (session === undefined || isTransaction(db) || driverOf(db) === 'pglite') return NOT_ARMED;
  let armed = true;
  let fired = false;
  const look = async (dropped: boolean) => {
    // A lease lost to a dropped connection aborts from its close, in the turn that may have reset the pool's
    // other connections too, not heard closed yet: a statement sent on one now would strand it (nextTurn).
    // Otherwise at once, ahead of what the caller sends next (a grant of the same lock, on a small pool).
    if (dropped) await nextTurn();
    for (let i = 0; i < MAX_LOOKS && armed; i++) {
      // A pool with no other connection free runs this once the transaction gave its back: it finds it gone.
      const found = await cancelStatement(db, session).catch(() => 'idle' as const);
      if (found === 'gone') return;
      await sleep(LOOK_EVERY_MS, undefined, { ref: false });
    }
  };
  const onAbort = () => {
    if (fired || !armed) return;
    // Not refusable (a single node-postgres client: `db` is the transaction's own connection, where a
    // look would run inside the transaction and cancel itself): nothing is done here.
    if (!refuseStatements(tx, reason())) return;
    fired = true;
    void look(signals.some((s) => s.aborted && lostToDroppedConnection(s.reason)));
  };
  const unwatch = signals.map((signal) => watch(signal, onAbort));
  // Aborted before the listeners were there (between the claim and now).
  if (signals.some((s) => s.aborted)) onAbort();
  return {
    disarm: () => {
      armed = false;
      for (const stop of unwatch) stop();
      return fired;
    },
  };
}

// One abort listener per signal, however many transactions of its lease run at once: a listener each
// made Node warn of a leak (MaxListenersExceededWarning) from the eleventh on.
const watchers = new WeakMap<AbortSignal, { readonly calls: Set<() => void>; readonly fire: () => void }>();

/** Calls `onAbort` when `signal` aborts, until the returned function is called. */
function watch(signal: AbortSignal, onAbort: () => void): () => void {
  let watcher = watchers.get(signal);
  if (!watcher) {
    const calls = new Set<() => void>();
    const fire = () => {
      watchers.delete(signal);
      for (const call of [...calls]) call();
    };
    watcher = { calls, fire };
    watchers.set(signal, watcher);
    signal.addEventListener('abort', fire, { once: true });
  }
  const { calls, fire } = watcher;
  calls.add(onAbort);
  return () => {
    calls.delete(onAbort);
    // The last one gone: so is the listener, and a long-lived signal keeps none.
    if (calls.size === 0 && watchers.get(signal) === watcher) {
      watchers.delete(signal);
      signal.removeEventListener('abort', fire);
    }
  };
}
