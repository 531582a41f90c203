/**
 * The write path of one fenced table: README, "The write path" and "Two
 * scopes of fencing". The API and its guarantees are in `repository-api.ts`.
 */
import { and, isNull, type SQL, sql } from 'drizzle-orm';
import { unansweredWrite } from '../commit-outcome.js';
import {
  assertSupportedDriver,
  asThrown,
  callerCode,
  count,
  type Database,
  execute,
  int8,
  isTransaction,
  type RawRow,
  transaction,
  translateError,
} from '../driver.js';
import { InvalidArgumentError, LockScopeError } from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { assertMaySend } from '../overlap.js';
import { prepared } from '../prepared.js';
import { observeBatch, observeWrite } from '../telemetry/writes.js';
import { checkCondition } from './conditions.js';
import { joining, on, recordingRefusals, recordRefusal } from './joined.js';
import {
  boundIdle,
  claimOf,
  inClaim,
  type LockScope,
  leasedRepository,
  needsIdleBound,
  returningOf,
  type WriteCore,
} from './lock-scope.js';
import { PURGE_ATTEMPTS, purgeStatement } from './purge.js';
import { refusals } from './refusals.js';
import { afterRanOut, endedByIdleBound, noteClaim } from './register-claim.js';
import type { FencedRepository, RepositoryOptions } from './repository-api.js';

export type {
  FencedRepository,
  FenceHolder,
  LeasedRepository,
  RepositoryOptions,
  StaleWriteEvent,
} from './repository-api.js';

import type { WriteResult } from './result.js';
import type { ClaimMode } from './statement-keys.js';
import {
  APPLIED,
  deleteStatements,
  type FencedWrite,
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
  keyWhere,
  mapRow,
  type PatchOf,
  patchEntries,
  type RowOf,
  type ValuesOf,
} from './table.js';
import { findPlan, learnPlan, PlannedWrite } from './update-plan.js';

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
  // Asked once: a write runs in a transaction when the repository is on one, or joins one (`on(db) !== db`).
  const onTransaction = isTransaction(db);

  const run = (on: Database, s: Statement): Promise<RawRow[]> => prepared(on, s.key, s.build).rows(s.values);
  // What a write's failure says when the write went out on its own, with no transaction around it: its
  // outcome is unknown unless the server answered (unansweredWrite). In a transaction its end decides.
  const onItsOwn = (on: Database) => (!onTransaction && on === db ? unansweredWrite : undefined);
  const runWrite = (on: Database, s: Statement): Promise<RawRow[]> => {
    const failed = onItsOwn(on);
    return failed ? run(on, s).then(undefined, failed) : run(on, s);
  };

  // The success path: the plain write, and nothing else when it applied (for `status` the statement
  // returns nothing and its row count tells). Otherwise the refusal statement tries the write again
  // (it applies if the row became writable in between) and explains. One promise on the way: each
  // async frame more costs a promise and a turn of the microtask queue on every write.
  function write(on: Database, w: FencedWrite, fence: Fence, scope: LockScope | undefined) {
    const attempt = (): Promise<WriteResult<RowOf<T>>> => {
      const statement = prepared(on, w.write.key, w.write.build);
      // On the statement's own failure only (the `then`'s second argument: no promise more on the success path).
      const failed = onItsOwn(on);
      if (w.returning === 'row') {
        return statement.rows(w.write.values).then((rows) => {
          const row = rows[0];
          return row === undefined ? refusalPath(on, w, fence, scope) : appliedAt(row, w, fence);
        }, failed);
      }
      return statement
        .count(w.write.values)
        .then((n) => (n > 0 ? appliedAt(NO_ROW, w, fence) : refusalPath(on, w, fence, scope)), failed);
    };
    const bounded =
      scope !== undefined && (onTransaction || on !== db) && needsIdleBound(on, scope)
        ? () => boundFirst(on, w, fence, scope, attempt)
        : attempt;
    return observeWrite(info.label, w.method, 'UPDATE', fence, bounded);
  }

  // In a transaction not yet bounded for this lock, the claim would hold the register row unbounded: the
  // bound goes first. A holder whose TTL ran out bounds nothing and reads the register (afterRanOut); one
  // whose TTL runs out after the bound, and whose session the bound ended, hears LeaseLostError.
  async function boundFirst(
    on: Database,
    w: FencedWrite,
    fence: Fence,
    scope: LockScope,
    attempt: () => Promise<WriteResult<RowOf<T>>>,
  ): Promise<WriteResult<RowOf<T>>> {
    try {
      if (scope.ranOut()) return lockRefusal(w.key, fence, await afterRanOut(on, scope.lock, fence));
      await boundIdle(on, scope, fence);
      return await attempt();
    } catch (err) {
      throw (scope.ranOut() && endedByIdleBound(err, scope.lock.name, fence)) || err;
    }
  }

  // Off the success path: the refusal statement tries the write again and explains. Lock scope: it
  // runs only under a claim of the register, which then stays locked until it is done (or names
  // the higher fence that claimed the lock).
  function refusalPath(on: Database, w: FencedWrite, fence: Fence, scope: LockScope | undefined) {
    const refuse = async (tx: Database): Promise<WriteResult<RowOf<T>>> => {
      // It writes too, where the row became writable in between.
      const raw = (await runWrite(tx, w.refusal))[0] ?? {};
      if (raw[APPLIED] === true) return applied(raw, w.returning);
      return explain(tx, w.method, raw, w.key, fence);
    };
    if (scope === undefined) return refuse(on);
    return inClaim(on, scope, fence, refuse, (registered) => lockRefusal(w.key, fence, registered));
  }

  // Applied, so a lock-scoped write's lock is claimed at this fence: later writes of it share the
  // register by its key.
  function appliedAt(raw: RawRow, { claim, returning }: FencedWrite, fence: Fence) {
    if (claim !== undefined && !claim.shared) noteClaim(claim.lock, fence, fence);
    return applied(raw, returning);
  }

  const { explain, refusal, report, lockRefusal } = refusals<RowOf<T>>(info, same, options.onStale);

  async function writeUpsert(on: Database, key: [string, unknown][], fence: Fence, statement: Statement) {
    return observeWrite(info.label, 'upsert', 'INSERT', fence, async () => {
      const raw = (await runWrite(on, statement))[0] ?? {};
      if (raw[APPLIED] === true) return applied(raw, 'row');
      return explain(on, 'upsert', raw, key, fence);
    });
  }

  // An applied result needs no context: `mustApply` returns its row.
  const applied = (raw: RawRow, returning: Returning): WriteResult<RowOf<T>> => ({
    status: 'applied',
    row: (returning === 'row' ? mapRow(info, raw) : undefined) as RowOf<T>,
  });

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
    const mode: ClaimMode = claim === undefined ? 'none' : claim.shared ? 'shared' : 'claim';
    // A shape of plain values written before: its plan, and only this write's values.
    const plan = findPlan(info, same, returning, mode, patch);
    if (typeof plan === 'object') {
      return write(on, new PlannedWrite(info, plan, same, key, patch, fence, returning, claim), fence, scope);
    }
    if (plan === 'unplanned') {
      learnPlan(
        info,
        same,
        returning,
        mode,
        patch.map(([name]) => name),
      );
    }
    return write(on, updateStatements(info, key, patch, fence, same, returning, claim), fence, scope);
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
      return write(on(db), deleteStatements(info, key, fence, same, claim), fence, scope);
    },

    async modify(keyIn, fenceIn, fn, scope) {
      const fence = assertFence(fenceIn);
      const key = keyEntries(info, keyIn);
      if (typeof fn !== 'function') throw new InvalidArgumentError('modify needs a function that returns the patch');
      const run = (tx: Database) => modify(tx, key, keyIn, fence, fn);
      try {
        if (scope === undefined) return await run(on(db));
        return await inClaim(on(db), scope, fence, run, (registered) => lockRefusal(key, fence, registered), true);
      } catch (err) {
        throw asThrown(err);
      }
    },

    async updateWhere(where, fenceIn, patchIn, opts = {}, scope = undefined) {
      const fence = assertFence(fenceIn);
      checkCondition(where, 'updateWhere');
      const patch = patchEntries(info, patchIn, false);
      const statement = updateWhereStatement(info, where, patch, fence, same, opts.allOrNothing === true);
      return observeBatch(info.label, fence, async () => {
        const batch = async (tx: Database) => {
          const [row] = await runWrite(tx, statement);
          const result = { applied: count(row?.applied), stale: count(row?.stale) };
          // In a fenced transaction a row left stale refuses it all, as a refused single write does.
          if (result.stale > 0 && recordingRefusals()) await recordBatchRefusal(tx, where, fence);
          return result;
        };
        if (scope === undefined) return batch(on(db));
        // Refused by the register: every live row the condition matches counts as stale.
        return inClaim(on(db), scope, fence, batch, async (registered, tx) => {
          const [row] = await execute(
            tx,
            sql`select count(*) as n from ${t} where (${where}) and ${isNull(t.deletedAt)}`,
          );
          recordRefusal({
            status: 'stale',
            table: info.label,
            key: null,
            attemptedFence: fence,
            currentFence: registered,
          });
          return { applied: 0, stale: count(row?.n) };
        });
      });
    },
  };

  // What a fenced transaction reports for an updateWhere that left rows stale: the highest fence among the
  // rows its condition matches now (tombstones too; read only on this path), `duplicate` when that is its own.
  async function recordBatchRefusal(tx: Database, where: SQL, fence: Fence): Promise<void> {
    const [row] = await execute(tx, sql`select max(${t.lastFence}) as fence from ${t} where (${where})`);
    const highest = int8(row?.fence) ?? fence;
    const currentFence = highest > fence ? highest : fence;
    const status = currentFence === fence && same === 'reject' ? 'duplicate' : 'stale';
    recordRefusal({ status, table: info.label, key: null, attemptedFence: fence, currentFence });
  }

  async function modify(
    on: Database,
    key: [string, unknown][],
    keyIn: KeyOf<T>,
    fence: Fence,
    fn: (row: RowOf<T>, tx: Database) => PatchOf<T> | Promise<PatchOf<T>>,
  ): Promise<WriteResult<RowOf<T>>> {
    return transaction(on, async (tx) => {
      // A locking read, sent through drizzle: checked as palisade's statements are (overlap.ts), or a
      // modify left running past its transaction would lock the row in whatever its session runs next.
      assertMaySend(tx);
      const [row] = await tx.select().from(t).where(keyWhere(info, key)).for('update');
      const locked = row as (RowOf<T> & { lastFence: bigint; deletedAt: Date | null }) | undefined;
      // The locked row decides (one row version): absent or deleted is `missing`, nothing written.
      if (!locked || locked.deletedAt !== null) return report({ status: 'missing' }, key, fence);
      const refused = refusal(locked.lastFence, fence);
      if (refused) return report(refused, key, fence);
      // Inside fn, this repository (and any other on the same db) reads and writes through the
      // transaction: on PGlite, or a pool of one, the outer db would wait behind it forever.
      // The caller's own error (say, "insufficient funds") rolls back every transaction around it
      // and comes out of modify as it was thrown, not dressed as a DatabaseError.
      const patch = await joining(db, tx, undefined, () => callerCode(() => fn(locked, tx)), on);
      return update(tx, keyIn, fence, patch, 'row');
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
          .where(and(keyWhere(info, key), isNull(t.deletedAt)))
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

    // Bad input rejects the promise, like every other method, rather than throwing.
    // Four named parameters, not a rest array: this runs on every write.
    update: ((key: KeyOf<T>, fence: Fence, patch: PatchOf<T>, opts?: unknown) => {
      try {
        return rowScoped().update(key, fence, patch, returningOf(opts), undefined);
      } catch (err) {
        return Promise.reject(err);
      }
    }) as FencedRepository<T>['update'],
    upsert: async (values, fence) => rowScoped().upsert(values, fence, undefined),
    delete: async (key, fence) => rowScoped().delete(key, fence, undefined),
    modify: async (key, fence, fn) => rowScoped().modify(key, fence, fn, undefined),
    updateWhere: async (where, fence, patch, opts) => rowScoped().updateWhere(where, fence, patch, opts, undefined),

    async purgeTombstones(olderThan, opts = {}) {
      const batchSize = opts.batchSize ?? 1000;
      // A batch can find every tombstone it chose gone — another purge removed them while this one
      // waited, or a writer brought them back — though others remain: it picks again, a bounded number
      // of times, passing over rows other transactions hold, so that 0 means none was left to purge.
      for (let attempt = 1; ; attempt++) {
        const [row] = await execute(on(db), purgeStatement(info, olderThan, batchSize, attempt > 1));
        const n = count(row?.n);
        if (n > 0 || count(row?.picked) === 0 || attempt === PURGE_ATTEMPTS) return n;
      }
    },

    with(holder) {
      return leasedRepository(core, holder, scope);
    },
  };
  return repo;
}
