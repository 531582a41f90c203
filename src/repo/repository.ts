import { AsyncLocalStorage } from 'node:async_hooks';
import { and, eq, is, isNull, lt, SQL, sql } from 'drizzle-orm';
import type { PgColumn } from 'drizzle-orm/pg-core';
import {
  assertSupportedDriver,
  count,
  type Database,
  execute,
  int8,
  prepared,
  type RawRow,
  transaction,
  translateError,
} from '../driver.js';
import { InvalidArgumentError, LeaseLostError, PalisadeError, RetryableWriteError } from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { observeBatch, observeWrite } from '../telemetry/writes.js';
import { type BatchResult, rememberContext, type WriteResult } from './result.js';
import {
  APPLIED,
  deleteStatements,
  type FencedWrite,
  FLOOR,
  PREV_DELETED,
  PREV_FENCE,
  type Returning,
  type SameFence,
  type Statement,
  updateStatements,
  updateWhereStatement,
  upsertStatement,
} from './statements.js';
import {
  describeTable,
  type FencedTable,
  type KeyOf,
  keyEntries,
  mapRow,
  type PatchOf,
  patchEntries,
  type RowOf,
  type ValuesOf,
} from './table.js';

// While a `modify` callback runs: the transaction that stands in for the database it was opened
// on, so that reads and writes of repositories on that database inside the callback join it.
const joined = new AsyncLocalStorage<ReadonlyMap<Database, Database>>();

function withJoined(db: Database, tx: Database): ReadonlyMap<Database, Database> {
  const map = new Map(joined.getStore() ?? []);
  map.set(db, tx);
  return map;
}

/** `db`, or the transaction of the `modify` callback that is running on it. */
function on(db: Database): Database {
  return joined.getStore()?.get(db) ?? db;
}

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
}

/** A write the database refused because its fence was not above the row's. */
export interface StaleWriteEvent {
  readonly table: string;
  readonly key: Readonly<Record<string, unknown>>;
  readonly attemptedFence: Fence;
  /** The row's fence, equal to `attemptedFence` for a duplicate. */
  readonly currentFence: Fence;
}

/** Anything that carries a fence and tells when it should no longer be used: a lock manager's lease. */
export interface FenceHolder {
  readonly fence: Fence;
  readonly signal: AbortSignal;
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
   * and comes out as thrown.
   */
  modify(
    key: KeyOf<T>,
    fence: Fence,
    fn: (row: RowOf<T>, tx: Database) => PatchOf<T> | Promise<PatchOf<T>>,
  ): Promise<WriteResult<RowOf<T>>>;
  /**
   * Fenced update of every live row matching `where`. Returns how many rows
   * applied and how many were at or above the fence. With `allOrNothing`,
   * the rows are locked first and none is written if any is stale.
   */
  updateWhere(where: SQL, fence: Fence, patch: PatchOf<T>, options?: { allOrNothing?: boolean }): Promise<BatchResult>;
  /**
   * Removes up to `batchSize` tombstones deleted before `olderThan` and
   * returns how many it removed; call until 0. In the same statement it
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
   */
  with(holder: FenceHolder): LeasedRepository<T>;
}

/** {@link FencedRepository} bound to one lease: the fence argument is implied. */
export interface LeasedRepository<T extends FencedTable> {
  readonly fence: Fence;
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

/**
 * Creates the write path for `table` on `db` — a drizzle postgres-js,
 * node-postgres or PGlite database, or a transaction of one (then every
 * write joins it).
 *
 * @throws {InvalidArgumentError} if `db` is not a drizzle database on one of
 * those drivers (checked here, before any query), or `table` lacks
 * `fenceColumns()` or a primary key.
 */
export function fencedRepository<T extends FencedTable>(
  db: Database,
  table: T,
  options: RepositoryOptions = {},
): FencedRepository<T> {
  assertSupportedDriver(db, 'fencedRepository');
  const info = describeTable(table);
  const same: SameFence = options.sameFence ?? 'reject';
  if (same !== 'reject' && same !== 'allow') throw new InvalidArgumentError("sameFence must be 'reject' or 'allow'");
  const t = table as FencedTable;

  const keyWhere = (key: [string, unknown][]) =>
    and(...key.map(([name, value]) => eq(info.columns[name] as PgColumn, value))) as SQL;

  async function run(on: Database, statement: Statement): Promise<RawRow[]> {
    return prepared(on, statement.key, statement.build)(statement.values);
  }

  // The success path: the plain write, and nothing else when it applied. Otherwise the refusal
  // statement tries the write again (it applies if the row became writable in between) and explains.
  async function write(
    on: Database,
    method: 'update' | 'delete',
    key: [string, unknown][],
    fence: Fence,
    statements: FencedWrite,
    returning: Returning,
  ): Promise<WriteResult<RowOf<T>>> {
    return observeWrite(info.label, method, 'UPDATE', fence, async () => {
      const [written] = await run(on, statements.write);
      if (written !== undefined) return applied(written, returning);
      const raw = (await run(on, statements.refusal))[0] ?? {};
      if (raw[APPLIED] === true) return applied(raw, returning);
      return explain(on, method, raw, key, fence);
    });
  }

  async function writeUpsert(on: Database, key: [string, unknown][], fence: Fence, statement: Statement) {
    return observeWrite(info.label, 'upsert', 'INSERT', fence, async () => {
      const raw = (await run(on, statement))[0] ?? {};
      if (raw[APPLIED] === true) return applied(raw, 'row');
      return explain(on, 'upsert', raw, key, fence);
    });
  }

  // An applied result needs no context: `mustApply` returns its row.
  const applied = (raw: RawRow, returning: Returning): WriteResult<RowOf<T>> => ({
    status: 'applied',
    row: (returning === 'row' ? mapRow(info, raw) : undefined) as RowOf<T>,
  });

  async function explain(on: Database, method: string, raw: RawRow, key: [string, unknown][], fence: Fence) {
    let result = classify(method, raw, fence);
    if (result === 'race') result = await reclassify(on, method, key, fence);
    return report(result, key, fence);
  }

  // The serial model (README, "The write path"): update, modify and delete write a LIVE row whose
  // fence is below theirs; a tombstone or an absent row is `missing` and nothing is written. An
  // upsert writes a live row or a tombstone below its fence, and creates an absent row only above
  // the table's tombstone floor. `stale` names the fence that refused; `duplicate` means this very
  // fence wrote the row. The statement decides on one row version; the previous row read beside it
  // (the statement's snapshot) explains a refusal, unless the row changed while the statement waited
  // for its lock: then the row is read again and the refusal explained by that later state.
  function classify(method: string, raw: RawRow, fence: Fence): WriteResult<RowOf<T>> | 'race' {
    const prevFence = int8(raw[PREV_FENCE]);
    const prevDeleted = raw[PREV_DELETED] === true;
    if (method !== 'upsert') {
      // Not live in the snapshot: the write's WHERE excluded the row without waiting for it.
      if (prevFence === null || prevDeleted) return { status: 'missing' };
      return refusal(prevFence, fence) ?? 'race';
    }
    if (prevFence === null) {
      // Absent from the snapshot: the insert was not attempted when the floor refused the fence.
      const floor = int8(raw[FLOOR]);
      if (floor !== null && !writable(floor, fence)) return { status: 'stale', currentFence: floor as Fence };
    }
    // ON CONFLICT decided on the newest row version, which may be newer than the snapshot's: a
    // refusal explained by the snapshot could name the wrong fence (say `duplicate` where a higher
    // fence deleted the row while the upsert waited for it). Read the row again.
    return 'race';
  }

  const writable = (current: bigint, fence: bigint) => (same === 'allow' ? current <= fence : current < fence);

  function refusal(current: bigint, fence: Fence): WriteResult<RowOf<T>> | undefined {
    if (current > fence) return { status: 'stale', currentFence: current as Fence };
    if (current === fence && same === 'reject') return { status: 'duplicate' };
    return undefined;
  }

  async function reclassify(on: Database, method: string, key: [string, unknown][], fence: Fence) {
    const [row] = await execute(
      on,
      sql`select ${t.lastFence} as fence, ${t.deletedAt} is not null as deleted from ${t} where ${keyWhere(key)}`,
    );
    const current = row ? int8(row.fence) : null;
    if (method !== 'upsert' && (current === null || row?.deleted === true)) return { status: 'missing' } as const;
    // Fences of a row only rise while it exists, so a refusal by the row as it is now is also a
    // refusal by the version that decided: the write is placed (serially) at this read.
    let refused = current === null ? undefined : refusal(current, fence);
    if (current === null && method === 'upsert') {
      const [floorRow] = await execute(
        on,
        sql`select floor from palisade.tombstone_floors where table_name = ${info.label}`,
      );
      const floor = int8(floorRow?.floor);
      if (floor !== null && !writable(floor, fence)) refused = { status: 'stale', currentFence: floor as Fence };
    }
    if (refused) return refused;
    // Writable now, yet the write did not apply (the row changed again since, or a purge removed
    // it): no serial explanation is at hand, so the caller retries.
    throw new RetryableWriteError('race', undefined);
  }

  function report(result: WriteResult<RowOf<T>>, key: [string, unknown][], fence: Fence) {
    const keyObject = Object.fromEntries(key);
    rememberContext(result, { table: info.label, key: keyObject, fence });
    if (options.onStale && (result.status === 'stale' || result.status === 'duplicate')) {
      const currentFence = result.status === 'stale' ? result.currentFence : fence;
      try {
        options.onStale({ table: info.label, key: keyObject, attemptedFence: fence, currentFence });
      } catch {
        // An observer must not turn a correct refusal into a failure.
      }
    }
    return result;
  }

  function update(on: Database, keyIn: KeyOf<T>, fenceIn: Fence, patchIn: PatchOf<T>, returning: Returning) {
    const fence = assertFence(fenceIn);
    const key = keyEntries(info, keyIn);
    const patch = patchEntries(info, patchIn, false);
    return write(on, 'update', key, fence, updateStatements(info, key, patch, fence, same, returning), returning);
  }

  function returningOf(options: unknown): Returning {
    if (options === undefined) return 'row';
    const returning = (options as { returning?: unknown } | null)?.returning;
    if (returning === undefined || returning === 'row' || returning === 'status') return returning ?? 'row';
    throw new InvalidArgumentError("update's returning must be 'row' or 'status'");
  }

  const repo: FencedRepository<T> = {
    table,

    async get(keyIn) {
      const key = keyEntries(info, keyIn);
      try {
        const rows = await on(db)
          .select()
          .from(t)
          .where(and(keyWhere(key), isNull(t.deletedAt)))
          .limit(1);
        return rows[0] as RowOf<T> | undefined;
      } catch (err) {
        // drizzle's own error quotes the query's parameters in its message.
        throw translateError(err);
      }
    },

    async find(where) {
      if (where !== undefined) checkCondition(where, 'find');
      const live = isNull(t.deletedAt);
      try {
        return (await on(db)
          .select()
          .from(t)
          .where(where ? and(where, live) : live)) as RowOf<T>[];
      } catch (err) {
        throw translateError(err);
      }
    },

    // async: bad input rejects the promise, like every other method, rather than throwing.
    update: (async (key: KeyOf<T>, fence: Fence, patch: PatchOf<T>, opts?: unknown) =>
      update(on(db), key, fence, patch, returningOf(opts))) as FencedRepository<T>['update'],

    async upsert(valuesIn, fenceIn) {
      const fence = assertFence(fenceIn);
      const row = patchEntries(info, valuesIn, true);
      const key = keyEntries(info, Object.fromEntries(row.filter(([name]) => info.keyNames.includes(name))));
      return writeUpsert(on(db), key, fence, upsertStatement(info, key, row, fence, same));
    },

    async delete(keyIn, fenceIn) {
      const fence = assertFence(fenceIn);
      const key = keyEntries(info, keyIn);
      return write(on(db), 'delete', key, fence, deleteStatements(info, key, fence, same), 'row');
    },

    async modify(keyIn, fenceIn, fn) {
      const fence = assertFence(fenceIn);
      const key = keyEntries(info, keyIn);
      if (typeof fn !== 'function') throw new InvalidArgumentError('modify needs a function that returns the patch');
      // The caller's own error (say, "insufficient funds") rolls back and comes out as it was thrown,
      // not dressed as a DatabaseError by the transaction's error translation.
      let thrown: { error: unknown } | undefined;
      const call = async (row: RowOf<T>, tx: Database) => {
        try {
          return await fn(row, tx);
        } catch (error) {
          thrown = { error };
          throw error;
        }
      };
      return transaction(on(db), async (tx) => {
        const [row] = await tx.select().from(t).where(keyWhere(key)).for('update');
        const locked = row as (RowOf<T> & { lastFence: bigint; deletedAt: Date | null }) | undefined;
        // The locked row decides (one row version): absent or deleted is `missing`, nothing written.
        if (!locked || locked.deletedAt !== null) return report({ status: 'missing' }, key, fence);
        const refused = refusal(locked.lastFence, fence);
        if (refused) return report(refused, key, fence);
        // Inside fn, this repository (and any other on the same db) reads and writes through the
        // transaction: on PGlite, or a pool of one, the outer db would wait behind it forever.
        const patch = await joined.run(withJoined(db, tx), () => call(locked, tx));
        return update(tx, keyIn, fence, patch, 'row');
      }).catch((err: unknown) => {
        throw thrown ? thrown.error : err;
      });
    },

    async updateWhere(where, fenceIn, patchIn, opts = {}) {
      const fence = assertFence(fenceIn);
      checkCondition(where, 'updateWhere');
      const patch = patchEntries(info, patchIn, false);
      const statement = updateWhereStatement(info, where, patch, fence, same, opts.allOrNothing === true);
      return observeBatch(info.label, fence, async () => {
        const [row] = await run(on(db), statement);
        return { applied: count(row?.applied), stale: count(row?.stale) };
      });
    },

    async purgeTombstones(olderThan, opts = {}) {
      const batchSize = opts.batchSize ?? 1000;
      if (!(olderThan instanceof Date) || Number.isNaN(olderThan.getTime())) {
        throw new InvalidArgumentError('olderThan must be a valid Date');
      }
      if (!Number.isSafeInteger(batchSize) || batchSize < 1)
        throw new InvalidArgumentError('batchSize must be a positive integer');
      // One statement: the tombstones go and the floor rises to the highest fence among them in
      // the same transaction, so no moment exists in which a lower fence could recreate a row.
      // The delete re-checks `ctid` on the row it waited for: a tombstone resurrected meanwhile
      // has a new version (a new ctid) and stays.
      const rows = await execute(
        on(db),
        sql`with gone as (delete from ${t} where ctid = any(array(
          select ctid from ${t} where ${lt(t.deletedAt, olderThan)} limit ${batchSize}
        )) returning ${t.lastFence} as fence),
        raised as (insert into palisade.tombstone_floors (table_name, floor)
          select ${info.label}, max(fence) from gone having count(*) > 0
          on conflict (table_name) do update set floor = greatest(palisade.tombstone_floors.floor, excluded.floor))
        select count(*) as n from gone`,
      );
      return count(rows[0]?.n);
    },

    with(holder) {
      const fence = assertFence(holder?.fence, 'lease fence');
      if (!(holder.signal instanceof AbortSignal))
        throw new InvalidArgumentError('lease signal must be an AbortSignal');
      // The fence, unless the lease is already known lost: then refuse before any query.
      const live = (): Fence => {
        if (holder.signal.aborted) {
          const reason: unknown = holder.signal.reason;
          throw reason instanceof PalisadeError
            ? reason
            : new LeaseLostError('(lease)', fence, 'its signal was aborted');
        }
        return fence;
      };
      return {
        fence,
        update: (async (key: KeyOf<T>, patch: PatchOf<T>, opts?: { returning: 'status' }) =>
          repo.update(key, live(), patch, opts as { returning: 'status' })) as LeasedRepository<T>['update'],
        upsert: async (values) => repo.upsert(values, live()),
        delete: async (key) => repo.delete(key, live()),
        modify: async (key, fn) => repo.modify(key, live(), fn),
        updateWhere: async (where, patch, opts) => repo.updateWhere(where, live(), patch, opts),
      };
    },
  };
  return repo;
}

/**
 * A `where` must be drizzle SQL (`sql\`…\``, `eq(…)`, `and(…)`). Anything
 * else would be bound as a *parameter*: the string `'true'` becomes `where
 * $1` with `$1 = 'true'`, which Postgres casts to boolean — every row.
 */
function checkCondition(where: unknown, method: string): asserts where is SQL {
  let ok = false;
  if (where !== null && typeof where === 'object' && Object.getPrototypeOf(where) !== null) {
    try {
      ok = is(where, SQL);
    } catch {
      ok = false;
    }
  }
  if (!ok) {
    throw new InvalidArgumentError(
      `${method} needs its condition as drizzle SQL (sql\`…\`, eq(…), and(…)), not a string or other value; pass sql\`true\` for every row`,
    );
  }
}
