/**
 * Which transaction a repository's call joins: while a `modify` callback or
 * a fenced transaction runs, repositories on the database it was opened on
 * read and write through that transaction (README, "Fenced transactions").
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import type { Database } from '../driver.js';
import { enclosing } from '../overlap.js';

/** A write the database refused inside a fenced transaction, as the transaction reports it. */
export interface Refusal {
  readonly status: 'stale' | 'duplicate';
  /** The table, or `null` when the lock's register refused the claim at the start. */
  readonly table: string | null;
  /** The row's key; `null` for the register's refusal at the start, and for an `updateWhere` (many rows). */
  readonly key: Readonly<Record<string, unknown>> | null;
  readonly attemptedFence: bigint;
  readonly currentFence: bigint;
}

interface Scope {
  readonly transactions: ReadonlyMap<Database, Database>;
  /** Set inside a fenced transaction: every refused write is recorded here. */
  readonly refusals: Refusal[] | undefined;
}

const scope = new AsyncLocalStorage<Scope>();

/**
 * Runs `fn` with repositories on `db` joining `tx`; `refusals` collects the refused writes of a fenced
 * transaction. `via`: what `tx` was opened through (`on(db)`, or another name of the same session): it,
 * every savepoint and transaction `tx` was opened in (a lock-scoped modify's savepoint is opened in its
 * claim's), and every name that led to one of them, lead to `tx` inside `fn` — one session, one way in,
 * so that no call inside goes around `tx`'s savepoint.
 */
export function joining<R>(
  db: Database,
  tx: Database,
  refusals: Refusal[] | undefined,
  fn: () => R,
  via: Database = db,
): R {
  const outer = scope.getStore();
  const around = new Set(enclosing(tx)).add(via);
  const transactions = new Map<Database, Database>();
  for (const [name, joined] of outer?.transactions ?? []) transactions.set(name, around.has(joined) ? tx : joined);
  for (const name of around) transactions.set(name, tx);
  transactions.set(db, tx);
  return scope.run({ transactions, refusals: refusals ?? outer?.refusals }, fn);
}

/** `db`, or the transaction of the `modify` callback or fenced transaction that is running on it. */
export function on(db: Database): Database {
  return scope.getStore()?.transactions.get(db) ?? db;
}

/** Whether a fenced transaction runs, whose refused writes {@link recordRefusal} records. */
export function recordingRefusals(): boolean {
  return scope.getStore()?.refusals !== undefined;
}

/** Records a refused write when a fenced transaction runs (its whole transaction will roll back). */
export function recordRefusal(refusal: Refusal): void {
  scope.getStore()?.refusals?.push(refusal);
}
