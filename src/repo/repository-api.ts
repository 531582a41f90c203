/**
 * The shape of a fenced repository: what its writes guarantee, in TSDoc.
 * The write semantics and both scopes are in the README ("The write path",
 * "Two scopes of fencing").
 */
import type { SQL } from 'drizzle-orm';
import type { Database } from '../driver.js';
import type { Fence } from '../fencing/fence.js';
import type { LockIdentity } from '../fencing/lock-identity.js';
import type { BatchResult, WriteResult } from './result.js';
import type { SameFence } from './statements.js';
import type { FencedTable, KeyOf, PatchOf, RowOf, ValuesOf } from './table.js';

/** Options of {@link fencedRepository}. */
export interface RepositoryOptions {
  /**
   * `'reject'` (default): the comparison is `last_fence < $fence`, so a fence
   * writes a row at most once and a retry reports `duplicate`. `'allow'`:
   * `<=`, for holders that write the same row several times per grant. Both
   * refuse every fence below the highest accepted.
   */
  readonly sameFence?: SameFence;
  /** Called (synchronously, errors ignored) for every write refused as stale or duplicate. */
  readonly onStale?: (event: StaleWriteEvent) => void;
  /**
   * `'row'` (default): both scopes are open — bare-fence writes
   * (`repo.update(key, fence, patch)`, row-scoped) and `with(lease)`
   * (lock-scoped). `'lock'`: only lock-scoped writes; a bare-fence write, or
   * `with()` of a holder without a `lock`, rejects with `LockScopeError`
   * before any query, so nobody bypasses the lock scope by accident
   * (README, "Two scopes of fencing").
   */
  readonly scope?: 'row' | 'lock';
}

/** A write the database refused because its fence was not above the row's. */
export interface StaleWriteEvent {
  readonly table: string;
  readonly key: Readonly<Record<string, unknown>>;
  readonly attemptedFence: Fence;
  /** The row's fence, equal to `attemptedFence` for a duplicate. */
  readonly currentFence: Fence;
}

/**
 * Anything that carries a fence and tells when it should no longer be used:
 * a lock manager's lease. With `lock` (every built-in lease has it) writes
 * through `with(holder)` are lock-scoped; without it they are row-scoped.
 */
export interface FenceHolder {
  readonly fence: Fence;
  readonly signal: AbortSignal;
  /** The lock the fence was granted for (see {@link LockIdentity}); `undefined`/absent: row scope only. */
  readonly lock?: LockIdentity | undefined;
}

/** The write path of one fenced table. Reads take no fence; every write does. */
export interface FencedRepository<T extends FencedTable> {
  readonly table: T;
  /** The live row with this primary key, or `undefined` (tombstones are invisible). */
  get(key: KeyOf<T>): Promise<RowOf<T> | undefined>;
  /** Live rows matching `where` (all live rows without it). */
  find(where?: SQL): Promise<RowOf<T>[]>;
  /**
   * `UPDATE … SET patch, last_fence = fence WHERE key AND live AND last_fence < fence`:
   * one statement and one round trip on the success path; a write that did
   * not apply costs a second statement, which tries the write again and
   * says why not (README, "The write path"). Patch values may be SQL
   * expressions. Guarantees: applied only if no fence ≥ `fence` wrote the
   * row before. A deleted (or absent) row is `missing` and nothing is
   * written, its fence included. Does not: create the row (see `upsert`) or
   * retry.
   *
   * With `{ returning: 'status' }` the row is not sent back (`row` is
   * `undefined` when applied): less to transfer and decode, for callers
   * that only need the outcome.
   */
  update(
    key: KeyOf<T>,
    fence: Fence,
    patch: PatchOf<T>,
    options?: { returning?: 'row' },
  ): Promise<WriteResult<RowOf<T>>>;
  update(
    key: KeyOf<T>,
    fence: Fence,
    patch: PatchOf<T>,
    options: { returning: 'status' },
  ): Promise<WriteResult<undefined>>;
  /**
   * Fenced insert-or-update in one statement. A row deleted with a fence ≥
   * `fence` stays deleted (`stale`; `duplicate` when this fence deleted it).
   * A row that does not exist (never written, or its tombstone purged) is
   * created only by a fence above the table's tombstone floor, else `stale`
   * naming the floor. Columns not in `values` keep their current values on
   * update; a resurrected row takes their defaults. Needs palisade's
   * migrations (`migrate()`): it reads `palisade.tombstone_floors`.
   *
   * @throws {RetryableWriteError} (SQLSTATE 40001) when a purge that
   * committed while the statement ran raised the floor to `fence` or above
   * just as the upsert created the row: nothing is written, and a retry
   * reports `stale`.
   */
  upsert(values: ValuesOf<T>, fence: Fence): Promise<WriteResult<RowOf<T>>>;
  /**
   * Fenced delete of a live row that leaves a tombstone carrying the fence;
   * `row` is the row as it was deleted. One round trip on the success path,
   * two when it did not apply (as for `update`). A tombstone or an absent row is
   * `missing` and nothing is written (a retried delete reports `missing`).
   */
  delete(key: KeyOf<T>, fence: Fence): Promise<WriteResult<RowOf<T>>>;
  /**
   * Safe read-modify-write: locks the row (`FOR UPDATE`) in a transaction,
   * calls `fn(row, tx)` with it, and writes the patch fenced. `fn` is called
   * only when the locked row is live and its fence below `fence`, so the
   * write applies. Use this (or SQL expressions in an `update`) whenever the
   * new value depends on the old one: fencing only the write loses updates
   * read before a stale holder's write landed.
   *
   * `tx` is the transaction: read through it inside `fn`. While `fn` runs,
   * every repository on the same `db` (this one included) joins it too. The
   * outer `db` used directly would wait behind the transaction — forever on
   * PGlite or a pool of one connection. An error thrown by `fn` rolls back
   * and comes out as thrown. On a transaction it opens a savepoint: a call
   * that overlaps it on the same transaction (not made inside `fn`) is
   * refused with `InvalidArgumentError` before it sends anything, and so is
   * this call while another's savepoint is open there (README, "Fenced
   * transactions").
   */
  modify(
    key: KeyOf<T>,
    fence: Fence,
    fn: (row: RowOf<T>, tx: Database) => PatchOf<T> | Promise<PatchOf<T>>,
  ): Promise<WriteResult<RowOf<T>>>;
  /**
   * Fenced update of every live row matching `where`. Returns how many rows
   * applied and how many were at or above the fence. With `allOrNothing`,
   * the rows are locked first and none is written if any is stale. Inside
   * a fenced transaction a stale row refuses the whole transaction, as any
   * refused write inside does (README, "Fenced transactions").
   */
  updateWhere(where: SQL, fence: Fence, patch: PatchOf<T>, options?: { allOrNothing?: boolean }): Promise<BatchResult>;
  /**
   * Removes up to `batchSize` tombstones deleted before `olderThan` and
   * returns how many it removed; call until 0 (a batch that finds what it
   * chose already removed by a concurrent purge picks again, a bounded number
   * of times, passing over rows other transactions hold: 0 means none was
   * left but those). Concurrent purges of one table do not deadlock with
   * each other, except under multiple inheritance. In the same statement it
   * raises the table's tombstone floor (`palisade.tombstone_floors`) to the
   * highest fence it removed, and an upsert creates a row that does not exist
   * only with a fence above the floor: purging never lowers what a stale
   * fence must beat, whatever `olderThan` is. The price: after a purge, a
   * brand-new key also needs a fence above the floor. Needs `migrate()`.
   */
  purgeTombstones(olderThan: Date, options?: { batchSize?: number }): Promise<number>;
  /**
   * A view whose writes use `holder.fence` and refuse locally, before any
   * query, once `holder.signal` is aborted. The database check remains the
   * guarantee; the local check only saves a round trip.
   *
   * Lock scope, when the holder has a `lock` (every built-in lease):
   * each write also claims the lock's register (`palisade.lock_registers`)
   * in the same statement — one round trip on the success path — and
   * applies only if no higher fence of the same lock claimed it first;
   * otherwise it is `stale` with the register's fence as `currentFence`,
   * on every row, including rows that fence never wrote. Where the lock's
   * grants claim the register themselves (Postgres leases and advisory
   * locks on this database), the fence must be the lock's latest grant:
   * a fence that was never granted rejects with `FenceNotIssuedError`.
   * `update` and `delete` are one statement; `upsert`, `modify` and
   * `updateWhere` claim first in their own transaction (one statement more).
   * A holder whose `expiresAt` has passed (a lease whose signal has not
   * aborted yet) opens no such transaction: that write is `stale` where a
   * higher fence claimed the lock and otherwise rejects with
   * `LeaseLostError`, writing nothing.
   * Without a `lock`, the writes are row-scoped (as the bare-fence methods).
   *
   * @throws {LockScopeError} on a `scope: 'lock'` repository for a holder without `lock`.
   */
  with(holder: FenceHolder): LeasedRepository<T>;
}

/** {@link FencedRepository} bound to one lease: the fence argument is implied. */
export interface LeasedRepository<T extends FencedTable> {
  readonly fence: Fence;
  /** The lock whose register every write claims; `undefined` for a row-scoped view. */
  readonly lock: LockIdentity | undefined;
  update(key: KeyOf<T>, patch: PatchOf<T>, options?: { returning?: 'row' }): Promise<WriteResult<RowOf<T>>>;
  update(key: KeyOf<T>, patch: PatchOf<T>, options: { returning: 'status' }): Promise<WriteResult<undefined>>;
  upsert(values: ValuesOf<T>): Promise<WriteResult<RowOf<T>>>;
  delete(key: KeyOf<T>): Promise<WriteResult<RowOf<T>>>;
  modify(
    key: KeyOf<T>,
    fn: (row: RowOf<T>, tx: Database) => PatchOf<T> | Promise<PatchOf<T>>,
  ): Promise<WriteResult<RowOf<T>>>;
  updateWhere(where: SQL, patch: PatchOf<T>, options?: { allOrNothing?: boolean }): Promise<BatchResult>;
}
