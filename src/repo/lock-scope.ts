/**
 * Lock scope: writes that claim their lock's fence register (README, "Two
 * scopes of fencing"). The SQL of the register is in migration 0005.
 */
import { performance } from 'node:perf_hooks';
import { sql } from 'drizzle-orm';
import { assertSupportedDriver, type Database, int8, isTransaction, transaction } from '../driver.js';
import { FenceNotIssuedError, InvalidArgumentError, LeaseLostError, LockScopeError } from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { checkLockIdentity, type LockIdentity } from '../fencing/lock-identity.js';
import { prepared } from '../prepared.js';
import { sqlStateOf } from '../server-error.js';
import type { Claim } from './claim-guard.js';
import { on } from './joined.js';
import { lostError, type SessionOf, sessionColumnsSql, sessionOf, stopOnAbort } from './lost-lease.js';
import { registerKey, registerTag } from './register-key.js';
import type { FenceHolder, LeasedRepository } from './repository-api.js';
import { type BatchResult, rejecting, type WriteResult } from './result.js';
import type { Returning } from './statements.js';
import type { FencedTable, KeyOf, PatchOf, RowOf } from './table.js';

const p = (name: string) => sql.placeholder(name);
const claimSql = () =>
  sql`select palisade.claim_lock(${p('kind')}::text, ${p('source')}::text, ${p('namespace')}::text, ${p('name')}::text, ${p('fence')}::int8)::text as registered`;
/**
 * @internal Bounds the rest of the transaction's idle time to `idle` ms (then the server ends the
 * session), unless it is bounded tighter already: a write inside a fenced transaction, or in a
 * caller's transaction that set its own bound, must not loosen it (a modify inside a fenced
 * transaction once raised its bound to 60 s, and a paused holder kept every grant out that long).
 */
export const idleBoundSql = () =>
  sql`set_config('idle_in_transaction_session_timeout', least(nullif((extract(epoch from current_setting('idle_in_transaction_session_timeout')::interval) * 1000)::int8, 0), ${p('idle')}::int8)::text, true)`;
// Tags the transaction as a sharer of one register at one fence, by the placeholders `tag1` and `tag2`
// (registerTag): a raise above that fence ends such a sharer if it stalls mid-statement (migrations
// 0009, 0010). Never waits: a tag someone holds exclusively (a colliding advisory lock of their own) is
// not taken.
const tagSql = () => sql`pg_try_advisory_xact_lock_shared(${p('tag1')}::int4, ${p('tag2')}::int4)`;
const tagValues = (lock: LockIdentity, fence: Fence) => {
  const [tag1, tag2] = registerTag(lock, fence);
  return { tag1: String(tag1), tag2: String(tag2) };
};
// The same claim, and the transaction it opens (or joins) may sit idle at most `idle` ms.
// It names its session too, for a transaction to stop if its lease is lost (lost-lease.ts).
// It tags the transaction as the register's sharer too (migration 0009), which a raise reads.
const boundedClaimSql = () =>
  sql`select palisade.claim_lock(${p('kind')}::text, ${p('source')}::text, ${p('namespace')}::text, ${p('name')}::text, ${p('fence')}::int8)::text as registered,
    ${idleBoundSql()} as idle, ${tagSql()} as tagged, ${sessionColumnsSql()}`;

/** The most a claim's transaction may sit idle for a holder without an expiry estimate, as in fencedTransaction. */
const DEFAULT_IDLE_MS = 60_000;

/**
 * @internal What a lock-scoped write carries: its lock, and the most its
 * claim's transaction may sit idle — the holder's remaining TTL, asked when
 * a claim opens one — so a holder paused inside it cannot keep the register
 * row locked past its lease.
 */
export interface LockScope {
  readonly lock: LockIdentity;
  idleMs(): number;
  /** Whether the holder's TTL ran out by its own estimate (its signal aborts then, once its timers run). */
  ranOut(): boolean;
  /** The holder's signal: a `modify` whose lease is lost while its function runs is stopped. */
  readonly signal: AbortSignal;
}

// The fence at which this process last saw each lock's register claimed (a claim that held). A write
// of that fence then shares the register by its key alone (statements.ts, `Claim`); a wrong guess
// (the register moved, or the claim was on another database or rolled back) writes nothing there
// and falls to the refusal path, which claims.
const claimedAt = new WeakMap<LockIdentity, bigint>();

// The locks whose claim bounded a transaction's idle time in the first statement palisade sent in it (a
// fenced transaction's leases, a claim's own savepoint): nothing opened inside it yet, so no savepoint's
// rollback can undo that bound. A lock-scoped update or delete in a transaction bounds it for its own
// lock first when that lock is not here (one statement): a transaction palisade opened for another
// reason (a row-scoped modify), bounded by another lease, or the caller's own would otherwise let a
// holder paused in it keep this lock's register row locked.
const boundedBy = new WeakMap<Database, Set<string>>();
// A lock by value (its parts hold no NUL): an identity given as an open object is a new one on every check.
const lockText = (l: LockIdentity) => `${l.kind}\u0000${l.source}\u0000${l.namespace}\u0000${l.name}`;

/** @internal Notes that `tx`'s idle time is bounded for `lock` (by the lease that claimed it). */
export function noteBounded(tx: Database, lock: LockIdentity): void {
  const locks = boundedBy.get(tx);
  if (locks) locks.add(lockText(lock));
  else boundedBy.set(tx, new Set([lockText(lock)]));
}

const boundSql = () => sql`select ${idleBoundSql()} as idle, ${tagSql()} as tagged`;

/**
 * @internal Whether a lock-scoped write of `scope` in the transaction `tx` must first bound its idle
 * time: not where a claim of that lock bounded it already. (Outside a transaction a single statement
 * holds the register only while it runs: the caller asks only in one.)
 */
export const needsIdleBound = (tx: Database, scope: LockScope): boolean =>
  !boundedBy.get(tx)?.has(lockText(scope.lock));

/**
 * @internal Bounds `tx`'s idle time to `scope`'s TTL left (never loosening a tighter bound) and tags it
 * as a sharer of the lock at `fence`, in one statement.
 */
export async function boundIdle(tx: Database, scope: LockScope, fence: Fence): Promise<void> {
  // Not noted: sent through `tx`, the statement may run inside a savepoint opened on its connection
  // (yours, or a concurrent write's), whose rollback would undo the bound behind the note's back.
  await prepared(tx, 'palisade.idle_bound', boundSql).rows({
    idle: String(scope.idleMs()),
    ...tagValues(scope.lock, fence),
  });
}

/** @internal Notes what a claim of `lock` for `fence` found: the register's fence. */
export function noteClaim(lock: LockIdentity, fence: Fence, registered: bigint): void {
  if (registered === fence) claimedAt.set(lock, fence);
  else claimedAt.delete(lock);
}

/** @internal How a write of `fence` claims `scope`'s lock: shared by key once this process saw that claim hold. */
export const claimOf = (scope: LockScope | undefined, fence: Fence): Claim | undefined =>
  scope && { lock: scope.lock, shared: claimedAt.get(scope.lock) === fence };

/** @internal `holder`'s remaining TTL in whole ms by its expiry estimate; undefined without one. */
export function ttlLeft(holder: { readonly expiresAt?: unknown }): number | undefined {
  const at = holder.expiresAt;
  return typeof at !== 'number' || Number.isNaN(at) ? undefined : Math.floor(at - performance.now());
}

/** @internal `holder`'s remaining TTL in ms (at least 1), at most {@link DEFAULT_IDLE_MS}. */
export function idleBound(holder: { readonly expiresAt?: unknown }): number {
  const left = ttlLeft(holder);
  return left === undefined ? DEFAULT_IDLE_MS : Math.max(1, Math.min(DEFAULT_IDLE_MS, left));
}

/** @internal Whether `holder`'s TTL ran out by its expiry estimate. */
const ranOut = (holder: { readonly expiresAt?: unknown }): boolean => (ttlLeft(holder) ?? 1) < 1;

const registerFenceSql = () =>
  sql`select fence::text as registered from palisade.lock_registers where lock_key = ${p('lkey')}::uuid`;

/**
 * @internal What a lock-scoped write of a holder whose TTL ran out by its
 * own estimate does instead of opening or bounding a transaction, whose idle
 * bound would be 1 ms and end the session before its next statement (a
 * process resumed after a pause writes before its timers abort the signal):
 * returns the register's fence when a higher fence claimed the lock (read
 * without a lock: the write is `stale`), and otherwise throws
 * `LeaseLostError`. Nothing is written either way.
 */
export async function afterRanOut(on: Database, lock: LockIdentity, fence: Fence): Promise<Fence> {
  const [row] = await prepared(on, 'palisade.register_fence', registerFenceSql).rows({ lkey: registerKey(lock) });
  const registered = int8(row?.registered) ?? 0n;
  if (registered > fence) return registered as Fence;
  throw new LeaseLostError(lock.name, fence, 'its TTL ran out before the write');
}

/**
 * Claims `lock`'s register for `fence` on `on` and returns the register's
 * fence: `fence` when the claim holds (the register row stays locked until
 * `on`'s transaction ends), higher when a higher fence claimed it first.
 * @throws {FenceNotIssuedError} when the lock's grants claim the register on
 * this database and `fence` is above its latest grant.
 */
export async function claimLock(on: Database, lock: LockIdentity, fence: Fence, idleMs?: number): Promise<Fence> {
  if (idleMs !== undefined) return (await claimLockBounded(on, lock, fence, idleMs)).registered;
  const [row] = await prepared(on, 'palisade.claim_lock', claimSql).rows(claimValues(lock, fence));
  return registeredOf(row, lock, fence);
}

/**
 * @internal {@link claimLock} that also bounds the transaction's idle time to `idleMs` and names the
 * session it ran in.
 */
export async function claimLockBounded(
  on: Database,
  lock: LockIdentity,
  fence: Fence,
  idleMs: number,
): Promise<{ readonly registered: Fence; readonly session: SessionOf | undefined }> {
  const [row] = await prepared(on, 'palisade.claim_lock_bounded', boundedClaimSql).rows({
    ...claimValues(lock, fence),
    idle: String(idleMs),
    ...tagValues(lock, fence),
  });
  return { registered: registeredOf(row, lock, fence), session: sessionOf(row) };
}

const claimValues = ({ kind, source, namespace, name }: LockIdentity, fence: Fence) => ({
  kind,
  source,
  namespace,
  name,
  fence: fence.toString(),
});

// What a claim statement's row says: the register's fence, noted for later writes of `lock`.
function registeredOf(row: Record<string, unknown> | undefined, lock: LockIdentity, fence: Fence): Fence {
  const registered = int8(row?.registered) ?? 0n;
  noteClaim(lock, fence, registered);
  if (registered < fence) throw new FenceNotIssuedError(registered, fence);
  return registered as Fence;
}

// The claim, waiting at most `wait` ms for a register row another transaction holds (`lock_timeout`, set by
// the only row the claim is evaluated on, so before it).
const claimWithinSql = () =>
  sql`select palisade.claim_lock(${p('kind')}::text, ${p('source')}::text, ${p('namespace')}::text, ${p('name')}::text, ${p('fence')}::int8)::text as registered
    from (select set_config('lock_timeout', ${p('wait')}::text, true) as lock_timeout) s`;

/**
 * @internal {@link claimLock} in a statement of its own that waits at most `waitMs` (at least 1 ms) for a
 * register row locked by another transaction (a holder paused inside a fenced transaction); `null` when
 * the wait ran out (SQLSTATE 55P03) and nothing was claimed.
 */
export async function claimLockWithin(
  db: Database,
  lock: LockIdentity,
  fence: Fence,
  waitMs: number,
): Promise<Fence | null> {
  const wait = String(Math.max(1, Math.ceil(waitMs)));
  try {
    const rows = await prepared(db, 'palisade.claim_lock_within', claimWithinSql).rows({
      ...claimValues(lock, fence),
      wait,
    });
    return registeredOf(rows[0], lock, fence);
  } catch (err) {
    if (sqlStateOf(err) === '55P03') return null;
    throw err;
  }
}

/**
 * Runs `run` in a transaction (a savepoint inside one) that first claims
 * `lock` for `fence`; when a higher fence claimed it, `refused(register, tx)`
 * instead, and nothing is written. `callerRuns`: `run` runs the caller's
 * code (a `modify`'s function), so a transaction of its own — not a
 * savepoint, not PGlite — is stopped if the holder's signal aborts while it
 * runs (lost-lease.ts), and the call rejects with `LeaseLostError`. A holder
 * whose TTL ran out opens no transaction: {@link afterRanOut}.
 */
export async function inClaim<R>(
  on: Database,
  scope: LockScope,
  fence: Fence,
  run: (tx: Database) => Promise<R>,
  refused: (registered: Fence, tx: Database) => R | Promise<R>,
  callerRuns = false,
): Promise<R> {
  if (scope.ranOut()) return refused(await afterRanOut(on, scope.lock, fence), on);
  let stopper: ReturnType<typeof stopOnAbort> | undefined;
  const lost = () => lostError(scope.signal, fence);
  try {
    return await transaction(on, async (tx) => {
      const { registered, session } = await claimLockBounded(tx, scope.lock, fence, scope.idleMs());
      noteBounded(tx, scope.lock);
      if (registered !== fence) return refused(registered, tx);
      if (callerRuns) stopper = stopOnAbort(on, tx, session, [scope.signal], lost);
      let value: R;
      try {
        value = await run(tx);
      } finally {
        stopper?.disarm();
      }
      // Stopped after `run`'s last statement: what it wrote was rolled back, whatever it returned.
      if (stopper?.disarm()) throw lost();
      return value;
    });
  } catch (err) {
    // Stopped because the lease was lost: that is what the caller needs to hear.
    throw stopper?.disarm() ? lost() : err;
  }
}

/** @internal What a lock-scoped view needs of its repository: each write, optionally lock-scoped. */
export interface WriteCore<T extends FencedTable> {
  update(
    key: KeyOf<T>,
    fence: Fence,
    patch: PatchOf<T>,
    returning: Returning,
    scope: LockScope | undefined,
  ): Promise<WriteResult<RowOf<T>>>;
  upsert(values: unknown, fence: Fence, scope: LockScope | undefined): Promise<WriteResult<RowOf<T>>>;
  delete(key: KeyOf<T>, fence: Fence, scope: LockScope | undefined): Promise<WriteResult<RowOf<T>>>;
  modify(
    key: KeyOf<T>,
    fence: Fence,
    fn: (row: RowOf<T>, tx: Database) => PatchOf<T> | Promise<PatchOf<T>>,
    scope: LockScope | undefined,
  ): Promise<WriteResult<RowOf<T>>>;
  updateWhere(
    where: unknown,
    fence: Fence,
    patch: PatchOf<T>,
    options: { allOrNothing?: boolean } | undefined,
    scope: LockScope | undefined,
  ): Promise<BatchResult>;
}

/**
 * The view `repo.with(holder)` returns: lock-scoped when `holder.lock` is
 * set, row-scoped otherwise (refused with {@link LockScopeError} on a
 * `scope: 'lock'` repository).
 */
export function leasedRepository<T extends FencedTable>(
  core: WriteCore<T>,
  holder: FenceHolder,
  scope: 'row' | 'lock',
): LeasedRepository<T> {
  const fence = assertFence(holder?.fence, 'lease fence');
  if (!(holder.signal instanceof AbortSignal)) throw new InvalidArgumentError('lease signal must be an AbortSignal');
  const lock = holder.lock === undefined ? undefined : checkLockIdentity(holder.lock);
  if (lock === undefined && scope === 'lock') {
    throw new LockScopeError("this repository is lock-scoped (scope: 'lock'): with() needs a holder with a lock");
  }
  // The fence, unless the lease is already known lost: then refuse before any query.
  const live = (): Fence => {
    if (holder.signal.aborted) throw lostError(holder.signal, fence);
    return fence;
  };
  // The idle bound is asked per claim: the TTL left shrinks.
  const scoped: LockScope | undefined = lock && {
    lock,
    idleMs: () => idleBound(holder as { expiresAt?: unknown }),
    ranOut: () => ranOut(holder as { expiresAt?: unknown }),
    signal: holder.signal,
  };
  return {
    fence,
    lock,
    update: rejecting((key: KeyOf<T>, patch: PatchOf<T>, opts?: { returning?: unknown }) =>
      core.update(key, live(), patch, returningOf(opts), scoped),
    ) as LeasedRepository<T>['update'],
    upsert: async (values) => core.upsert(values, live(), scoped),
    delete: async (key) => core.delete(key, live(), scoped),
    modify: async (key, fn) => core.modify(key, live(), fn, scoped),
    updateWhere: async (where, patch, opts) => core.updateWhere(where, live(), patch, opts, scoped),
  };
}

/** `update`'s `returning` option, checked. */
export function returningOf(options: unknown): Returning {
  if (options === undefined) return 'row';
  const returning = (options as { returning?: unknown } | null)?.returning;
  if (returning === undefined || returning === 'row' || returning === 'status') return returning ?? 'row';
  throw new InvalidArgumentError("update's returning must be 'row' or 'status'");
}

/**
 * The eager claim: claims `holder.lock`'s register on `db` for
 * `holder.fence` now, in one statement, rather than at the first
 * lock-scoped write. Call it right after `acquire` where the backend does
 * not claim at grant (Redis, etcd, a Postgres manager on another database):
 * from then on every lock-scoped write of a lower fence of the lock is
 * refused, even on rows this holder never writes. Returns `claimed`, or
 * `stale` with the register's fence when a higher fence claimed it first.
 * On a database it holds no lock past its own statement; in a transaction
 * it holds the register row until that ends, and bounds the transaction's
 * idle time to the holder's TTL left (as a lock-scoped write does). Waits
 * for a register row another transaction holds as long as the session's
 * `lock_timeout` allows (by default, until that transaction ends). Inside
 * a `modify`'s function or a fenced transaction opened on `db`, it runs in
 * that transaction, as a repository on `db` does.
 * In a transaction, a holder whose `expiresAt` has passed claims nothing
 * (the bound would be 1 ms): `stale` where a higher fence claimed the lock.
 * @throws {LockScopeError} for a holder without `lock`; {@link FenceNotIssuedError}
 * for a fence above the latest grant of a lock whose grants claim on `db`;
 * `LeaseLostError` in a transaction for a holder whose `expiresAt` has
 * passed and whose lock no higher fence claimed.
 */
export async function claimLockRegister(
  db: Database,
  holder: FenceHolder,
): Promise<{ readonly status: 'claimed' } | { readonly status: 'stale'; readonly currentFence: Fence }> {
  assertSupportedDriver(db, 'claimLockRegister');
  const fence = assertFence(holder?.fence, 'lease fence');
  if (holder.lock === undefined || holder.lock === null) {
    throw new LockScopeError('claimLockRegister needs a holder with a lock (every built-in lease has one)');
  }
  // Inside a modify's function or a fenced transaction on `db`, it joins that transaction, as a repository does.
  const target = on(db);
  // In a transaction the claim holds the register row until it ends: bounded like a fenced transaction's.
  const inTransaction = isTransaction(target);
  const lock = checkLockIdentity(holder.lock);
  const estimated = holder as { readonly expiresAt?: unknown };
  const registered =
    inTransaction && ranOut(estimated)
      ? await afterRanOut(target, lock, fence)
      : await claimLock(target, lock, fence, inTransaction ? idleBound(estimated) : undefined);
  return registered === fence ? { status: 'claimed' } : { status: 'stale', currentFence: registered };
}
