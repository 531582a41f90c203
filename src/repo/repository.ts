/**
 * The write path of one fenced table: README, "The write path" and "Two
 * scopes of fencing". The API and its guarantees are in `repository-api.ts`.
 */
import { and, eq, isNull, type SQL, sql } from 'drizzle-orm';
import type { PgColumn } from 'drizzle-orm/pg-core';
import {
  assertSupportedDriver,
  count,
  type Database,
  execute,
  int8,
  type RawRow,
  transaction,
  translateError,
} from '../driver.js';
import { InvalidArgumentError, LockScopeError, RetryableWriteError } from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { prepared } from '../prepared.js';
import { observeBatch, observeWrite } from '../telemetry/writes.js';
import { checkCondition } from './conditions.js';
import { joining, on, recordRefusal } from './joined.js';
import {
  claimOf,
  inClaim,
  type LockScope,
  leasedRepository,
  noteClaim,
  returningOf,
  type WriteCore,
} from './lock-scope.js';
import { purgeStatement } from './purge.js';
import type { FencedRepository, RepositoryOptions } from './repository-api.js';

export type {
  FencedRepository,
  FenceHolder,
  LeasedRepository,
  RepositoryOptions,
  StaleWriteEvent,
} from './repository-api.js';

import { rememberContext, type WriteResult } from './result.js';
import {
  APPLIED,
  type Claim,
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

const NO_ROW: RawRow = Object.freeze({});

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
  const scope = options.scope ?? 'row';
  if (scope !== 'row' && scope !== 'lock') throw new InvalidArgumentError("scope must be 'row' or 'lock'");
  const t = table as FencedTable;

  const keyWhere = (key: [string, unknown][]) =>
    and(...key.map(([name, value]) => eq(info.columns[name] as PgColumn, value))) as SQL;

  const run = (on: Database, s: Statement): Promise<RawRow[]> => prepared(on, s.key, s.build).rows(s.values);

  // The plain write: its row when it applied, `undefined` when it did not. For `status`, the
  // statement returns nothing and its row count tells.
  async function attempt(on: Database, s: Statement, returning: Returning): Promise<RawRow | undefined> {
    if (returning === 'row') return (await run(on, s))[0];
    return (await prepared(on, s.key, s.build).count(s.values)) > 0 ? NO_ROW : undefined;
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
    scope: LockScope | undefined,
    claim: Claim | undefined,
  ): Promise<WriteResult<RowOf<T>>> {
    return observeWrite(info.label, method, 'UPDATE', fence, async () => {
      const written = await attempt(on, statements.write, returning);
      if (written !== undefined) {
        // Applied, so the lock is claimed at this fence: later writes of it share the register by key.
        if (claim !== undefined && !claim.shared) noteClaim(claim.lock, fence, fence);
        return applied(written, returning);
      }
      const refuse = async (tx: Database) => {
        const raw = (await run(tx, statements.refusal))[0] ?? {};
        if (raw[APPLIED] === true) return applied(raw, returning);
        return explain(tx, method, raw, key, fence);
      };
      // Lock scope: the refusal statement runs only under a claim of the register, which then
      // stays locked until it is done (or names the higher fence that claimed the lock).
      if (scope === undefined) return refuse(on);
      return inClaim(on, scope, fence, refuse, (registered) => lockRefusal(key, fence, registered));
    });
  }

  const lockRefusal = (key: [string, unknown][], fence: Fence, currentFence: Fence) =>
    report({ status: 'stale', currentFence }, key, fence);

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
    if (result.status === 'stale' || result.status === 'duplicate') {
      const currentFence = result.status === 'stale' ? result.currentFence : fence;
      recordRefusal({ status: result.status, table: info.label, key: keyObject, attemptedFence: fence, currentFence });
    }
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

  function update(
    on: Database,
    keyIn: KeyOf<T>,
    fenceIn: Fence,
    patchIn: PatchOf<T>,
    returning: Returning,
    scope?: LockScope,
  ) {
    const fence = assertFence(fenceIn);
    const key = keyEntries(info, keyIn);
    const patch = patchEntries(info, patchIn, false);
    const claim = claimOf(scope, fence);
    const statements = updateStatements(info, key, patch, fence, same, returning, claim);
    return write(on, 'update', key, fence, statements, returning, scope, claim);
  }

  // Row scope is closed on a `scope: 'lock'` repository: a bare fence would bypass the register.
  const rowScoped = (): WriteCore<T> => {
    if (scope !== 'lock') return core;
    throw new LockScopeError("this repository is lock-scoped (scope: 'lock'): write through with(lease)");
  };

  const core: WriteCore<T> = {
    update: (key, fence, patch, returning, scope) => update(on(db), key, fence, patch, returning, scope),

    async upsert(valuesIn, fenceIn, scope) {
      const fence = assertFence(fenceIn);
      const row = patchEntries(info, valuesIn as ValuesOf<T>, true);
      const key = keyEntries(info, Object.fromEntries(row.filter(([name]) => info.keyNames.includes(name))));
      const upsert = (tx: Database) => writeUpsert(tx, key, fence, upsertStatement(info, key, row, fence, same));
      if (scope === undefined) return upsert(on(db));
      return inClaim(on(db), scope, fence, upsert, (registered) => lockRefusal(key, fence, registered));
    },

    async delete(keyIn, fenceIn, scope) {
      const fence = assertFence(fenceIn);
      const key = keyEntries(info, keyIn);
      const claim = claimOf(scope, fence);
      return write(on(db), 'delete', key, fence, deleteStatements(info, key, fence, same, claim), 'row', scope, claim);
    },

    async modify(keyIn, fenceIn, fn, scope) {
      const fence = assertFence(fenceIn);
      const key = keyEntries(info, keyIn);
      if (typeof fn !== 'function') throw new InvalidArgumentError('modify needs a function that returns the patch');
      if (scope === undefined) return modify(on(db), key, keyIn, fence, fn);
      return inClaim(
        on(db),
        scope,
        fence,
        (tx) => modify(tx, key, keyIn, fence, fn),
        (registered) => lockRefusal(key, fence, registered),
      );
    },

    async updateWhere(where, fenceIn, patchIn, opts = {}, scope = undefined) {
      const fence = assertFence(fenceIn);
      checkCondition(where, 'updateWhere');
      const patch = patchEntries(info, patchIn, false);
      const statement = updateWhereStatement(info, where, patch, fence, same, opts.allOrNothing === true);
      return observeBatch(info.label, fence, async () => {
        const batch = async (tx: Database) => {
          const [row] = await run(tx, statement);
          return { applied: count(row?.applied), stale: count(row?.stale) };
        };
        if (scope === undefined) return batch(on(db));
        // Refused by the register: every live row the condition matches counts as stale.
        return inClaim(on(db), scope, fence, batch, async () => {
          const [row] = await execute(
            on(db),
            sql`select count(*) as n from ${t} where (${where}) and ${isNull(t.deletedAt)}`,
          );
          return { applied: 0, stale: count(row?.n) };
        });
      });
    },
  };

  async function modify(
    on: Database,
    key: [string, unknown][],
    keyIn: KeyOf<T>,
    fence: Fence,
    fn: (row: RowOf<T>, tx: Database) => PatchOf<T> | Promise<PatchOf<T>>,
  ): Promise<WriteResult<RowOf<T>>> {
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
    return transaction(on, async (tx) => {
      const [row] = await tx.select().from(t).where(keyWhere(key)).for('update');
      const locked = row as (RowOf<T> & { lastFence: bigint; deletedAt: Date | null }) | undefined;
      // The locked row decides (one row version): absent or deleted is `missing`, nothing written.
      if (!locked || locked.deletedAt !== null) return report({ status: 'missing' }, key, fence);
      const refused = refusal(locked.lastFence, fence);
      if (refused) return report(refused, key, fence);
      // Inside fn, this repository (and any other on the same db) reads and writes through the
      // transaction: on PGlite, or a pool of one, the outer db would wait behind it forever.
      const patch = await joining(db, tx, undefined, () => call(locked, tx));
      return update(tx, keyIn, fence, patch, 'row');
    }).catch((err: unknown) => {
      throw thrown ? thrown.error : err;
    });
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
      rowScoped().update(key, fence, patch, returningOf(opts), undefined)) as FencedRepository<T>['update'],
    upsert: async (values, fence) => rowScoped().upsert(values, fence, undefined),
    delete: async (key, fence) => rowScoped().delete(key, fence, undefined),
    modify: async (key, fence, fn) => rowScoped().modify(key, fence, fn, undefined),
    updateWhere: async (where, fence, patch, opts) => rowScoped().updateWhere(where, fence, patch, opts, undefined),

    async purgeTombstones(olderThan, opts = {}) {
      const rows = await execute(on(db), purgeStatement(info, olderThan, opts.batchSize ?? 1000));
      return count(rows[0]?.n);
    },

    with(holder) {
      return leasedRepository(core, holder, scope);
    },
  };
  return repo;
}
