import { and, eq, isNull, lt, type SQL, sql } from 'drizzle-orm';
import type { PgColumn } from 'drizzle-orm/pg-core';
import { count, type Database, execute, int8, prepared, type RawRow, transaction } from '../driver.js';
import { InvalidArgumentError, LeaseLostError, PalisadeError, RetryableWriteError } from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { observeBatch, observeWrite } from '../telemetry/otel.js';
import { type BatchResult, rememberContext, type WriteResult } from './result.js';
import {
  APPLIED,
  deleteStatement,
  PREV_DELETED,
  PREV_FENCE,
  type SameFence,
  type Statement,
  updateStatement,
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
   * `UPDATE … SET patch, last_fence = fence WHERE key AND last_fence < fence`,
   * one statement, one round trip. Patch values may be SQL expressions.
   * Guarantees: applied only if no fence ≥ `fence` wrote the row before.
   * Does not: create the row (see `upsert`) or retry.
   */
  update(key: KeyOf<T>, fence: Fence, patch: PatchOf<T>): Promise<WriteResult<RowOf<T>>>;
  /**
   * Fenced insert-or-update in one statement. A row deleted with a fence ≥
   * `fence` stays deleted (`stale`). Columns not in `values` keep their
   * current values on update; a resurrected row takes their defaults.
   */
  upsert(values: ValuesOf<T>, fence: Fence): Promise<WriteResult<RowOf<T>>>;
  /** Fenced delete that leaves a tombstone carrying the fence; `row` is the row as it was deleted. */
  delete(key: KeyOf<T>, fence: Fence): Promise<WriteResult<RowOf<T>>>;
  /**
   * Safe read-modify-write: locks the row (`FOR UPDATE`) in a transaction,
   * calls `fn` with it, and writes the patch fenced. `fn` is not called when
   * the write could not apply anyway. Use this (or SQL expressions in an
   * `update`) whenever the new value depends on the old one: fencing only the
   * write loses updates read before a stale holder's write landed.
   */
  modify(
    key: KeyOf<T>,
    fence: Fence,
    fn: (row: RowOf<T>) => PatchOf<T> | Promise<PatchOf<T>>,
  ): Promise<WriteResult<RowOf<T>>>;
  /**
   * Fenced update of every live row matching `where`. Returns how many rows
   * applied and how many were at or above the fence. With `allOrNothing`,
   * the rows are locked first and none is written if any is stale.
   */
  updateWhere(where: SQL, fence: Fence, patch: PatchOf<T>, options?: { allOrNothing?: boolean }): Promise<BatchResult>;
  /**
   * Removes up to `batchSize` tombstones deleted before `olderThan` and
   * returns how many it removed; call until 0. A purged tombstone no longer
   * stops a stale upsert: only purge tombstones older than the longest lease.
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
  update(key: KeyOf<T>, patch: PatchOf<T>): Promise<WriteResult<RowOf<T>>>;
  upsert(values: ValuesOf<T>): Promise<WriteResult<RowOf<T>>>;
  delete(key: KeyOf<T>): Promise<WriteResult<RowOf<T>>>;
  modify(key: KeyOf<T>, fn: (row: RowOf<T>) => PatchOf<T> | Promise<PatchOf<T>>): Promise<WriteResult<RowOf<T>>>;
  updateWhere(where: SQL, patch: PatchOf<T>, options?: { allOrNothing?: boolean }): Promise<BatchResult>;
}

/**
 * Creates the write path for `table` on `db` — a drizzle postgres-js or
 * PGlite database, or a transaction of either (then every write joins it).
 *
 * @throws {InvalidArgumentError} if `table` lacks `fenceColumns()` or a primary key.
 */
export function fencedRepository<T extends FencedTable>(
  db: Database,
  table: T,
  options: RepositoryOptions = {},
): FencedRepository<T> {
  const info = describeTable(table);
  const same: SameFence = options.sameFence ?? 'reject';
  if (same !== 'reject' && same !== 'allow') throw new InvalidArgumentError("sameFence must be 'reject' or 'allow'");
  const t = table as FencedTable;

  const keyWhere = (key: [string, unknown][]) =>
    and(...key.map(([name, value]) => eq(info.columns[name] as PgColumn, value))) as SQL;

  async function run(on: Database, statement: Statement): Promise<RawRow[]> {
    return prepared(on, statement.key, statement.build)(statement.values);
  }

  async function write(
    on: Database,
    method: 'update' | 'upsert' | 'delete',
    key: [string, unknown][],
    fence: Fence,
    statement: Statement,
  ): Promise<WriteResult<RowOf<T>>> {
    return observeWrite(info.label, method, method === 'upsert' ? 'INSERT' : 'UPDATE', fence, async () => {
      const raw = (await run(on, statement))[0] ?? {};
      let result = classify(method, raw, fence);
      if (result === 'race') result = await reclassify(on, method, key, fence);
      return report(result, key, fence);
    });
  }

  function classify(method: string, raw: RawRow, fence: Fence): WriteResult<RowOf<T>> | 'race' {
    const prevFence = int8(raw[PREV_FENCE]);
    const prevDeleted = raw[PREV_DELETED] === true;
    if (raw[APPLIED] === true) {
      // An update or delete that reached a tombstone only raised its fence.
      if (prevDeleted && method !== 'upsert') return { status: 'missing' };
      return { status: 'applied', row: mapRow(info, raw) as RowOf<T> };
    }
    if (prevFence === null) return method === 'upsert' ? 'race' : { status: 'missing' };
    if (prevDeleted && method !== 'upsert') return { status: 'missing' };
    if (prevFence > fence) return { status: 'stale', currentFence: prevFence as Fence };
    if (prevFence === fence && same === 'reject') return { status: 'duplicate' };
    // The row passed the check in our snapshot, yet the write did not apply:
    // a concurrent writer committed first. Read what it left.
    return 'race';
  }

  async function reclassify(on: Database, method: string, key: [string, unknown][], fence: Fence) {
    const [row] = await execute(
      on,
      sql`select ${t.lastFence} as fence, ${t.deletedAt} is not null as deleted from ${t} where ${keyWhere(key)}`,
    );
    const current = row ? int8(row.fence) : null;
    if (!row || current === null) return { status: 'missing' } as const;
    if (row.deleted === true && method !== 'upsert') return { status: 'missing' } as const;
    if (current > fence) return { status: 'stale', currentFence: current as Fence } as const;
    if (current === fence) return { status: 'duplicate' } as const;
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

  function update(on: Database, keyIn: KeyOf<T>, fenceIn: Fence, patchIn: PatchOf<T>) {
    const fence = assertFence(fenceIn);
    const key = keyEntries(info, keyIn);
    const patch = patchEntries(info, patchIn, false);
    return write(on, 'update', key, fence, updateStatement(info, key, patch, fence, same));
  }

  const repo: FencedRepository<T> = {
    table,

    async get(keyIn) {
      const key = keyEntries(info, keyIn);
      const rows = await db
        .select()
        .from(t)
        .where(and(keyWhere(key), isNull(t.deletedAt)))
        .limit(1);
      return rows[0] as RowOf<T> | undefined;
    },

    async find(where) {
      const live = isNull(t.deletedAt);
      return (await db
        .select()
        .from(t)
        .where(where ? and(where, live) : live)) as RowOf<T>[];
    },

    // async: bad input rejects the promise, like every other method, rather than throwing.
    update: async (key, fence, patch) => update(db, key, fence, patch),

    async upsert(valuesIn, fenceIn) {
      const fence = assertFence(fenceIn);
      const row = patchEntries(info, valuesIn, true);
      const key = keyEntries(info, Object.fromEntries(row.filter(([name]) => info.keyNames.includes(name))));
      return write(db, 'upsert', key, fence, upsertStatement(info, key, row, fence, same));
    },

    async delete(keyIn, fenceIn) {
      const fence = assertFence(fenceIn);
      const key = keyEntries(info, keyIn);
      return write(db, 'delete', key, fence, deleteStatement(info, key, fence, same));
    },

    async modify(keyIn, fenceIn, fn) {
      const fence = assertFence(fenceIn);
      const key = keyEntries(info, keyIn);
      if (typeof fn !== 'function') throw new InvalidArgumentError('modify needs a function that returns the patch');
      // The caller's own error (say, "insufficient funds") rolls back and comes out as it was thrown,
      // not dressed as a DatabaseError by the transaction's error translation.
      let thrown: { error: unknown } | undefined;
      const call = async (row: RowOf<T>) => {
        try {
          return await fn(row);
        } catch (error) {
          thrown = { error };
          throw error;
        }
      };
      return transaction(db, async (tx) => {
        const [row] = await tx.select().from(t).where(keyWhere(key)).for('update');
        const locked = row as (RowOf<T> & { lastFence: bigint; deletedAt: Date | null }) | undefined;
        const writable =
          locked &&
          locked.deletedAt === null &&
          (same === 'allow' ? locked.lastFence <= fence : locked.lastFence < fence);
        // When the write cannot apply, an empty patch still reports why (and raises a tombstone's fence).
        const patch = writable ? await call(locked) : {};
        return update(tx, keyIn, fence, patch as PatchOf<T>);
      }).catch((err: unknown) => {
        throw thrown ? thrown.error : err;
      });
    },

    async updateWhere(where, fenceIn, patchIn, opts = {}) {
      const fence = assertFence(fenceIn);
      if (!where) throw new InvalidArgumentError('updateWhere needs a where condition; pass sql`true` for every row');
      const patch = patchEntries(info, patchIn, false);
      const statement = updateWhereStatement(info, where, patch, fence, same, opts.allOrNothing === true);
      return observeBatch(info.label, fence, async () => {
        const [row] = await run(db, statement);
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
      const rows = await execute(
        db,
        sql`with gone as (delete from ${t} where ctid = any(array(
          select ctid from ${t} where ${lt(t.deletedAt, olderThan)} limit ${batchSize}
        )) returning 1) select count(*) as n from gone`,
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
        update: async (key, patch) => repo.update(key, live(), patch),
        upsert: async (values) => repo.upsert(values, live()),
        delete: async (key) => repo.delete(key, live()),
        modify: async (key, fn) => repo.modify(key, live(), fn),
        updateWhere: async (where, patch, opts) => repo.updateWhere(where, live(), patch, opts),
      };
    },
  };
  return repo;
}
