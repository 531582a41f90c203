/**
 * Claiming a lock's fence register (README, "Two scopes of fencing"): the
 * statements that claim it — alone, bounding their transaction's idle time,
 * or within a wait — what this process saw claimed, what a holder whose TTL
 * ran out reads instead, and the eager claim. The register's SQL is in
 * migrations 0005–0011.
 */
import { performance } from 'node:perf_hooks';
import { sql } from 'drizzle-orm';
import { assertSupportedDriver, asThrown, type Database, int8, isTransaction, translateError } from '../driver.js';
import { DatabaseError, FenceNotIssuedError, LeaseLostError, LockScopeError } from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { checkLockIdentity, type LockIdentity } from '../fencing/lock-identity.js';
import { prepared } from '../prepared.js';
import { sessionEnded, sqlStateOf } from '../server-error.js';
import { on } from './joined.js';
import { type SessionOf, sessionColumnsSql, sessionOf } from './lost-lease.js';
import { registerKey, registerTag } from './register-key.js';
import type { FenceHolder } from './repository-api.js';

const p = (name: string) => sql.placeholder(name);
const claimSql = () =>
  sql`select palisade.claim_lock(${p('kind')}::text, ${p('source')}::text, ${p('namespace')}::text, ${p('name')}::text, ${p('fence')}::int8)::text as registered`;
/**
 * @internal Bounds the rest of the transaction's idle time to `idle` ms (then the server ends the
 * session), unless it is bounded tighter already: a write inside a fenced transaction, or in a
 * caller's transaction that set its own bound, must not loosen it (a modify inside a fenced
 * transaction once raised its bound to 60 s, and a paused holder kept every grant out that long).
 * Not on PGlite, in process or behind pglite-socket (its `version()` names it): once the timeout fired
 * there, the next statement spun the process at full CPU forever (PGlite 0.5.14, an attack; PGlite
 * alone does it too), and its one session keeps every other client waiting behind the transaction anyway.
 */
export const idleBoundSql = () =>
  sql`set_config('idle_in_transaction_session_timeout', case when version() like '%PGlite%' then current_setting('idle_in_transaction_session_timeout') else least(nullif((extract(epoch from current_setting('idle_in_transaction_session_timeout')::interval) * 1000)::int8, 0), ${p('idle')}::int8)::text end, true)`;
// Tags the transaction as a sharer of one register at one fence, by the placeholders `tag1` and `tag2`
// (registerTag): a raise above that fence ends such a sharer if it stalls mid-statement (migrations
// 0009, 0010). Never waits: a tag someone holds exclusively (a colliding advisory lock of their own) is
// not taken.
export const tagSql = () => sql`pg_try_advisory_xact_lock_shared(${p('tag1')}::int4, ${p('tag2')}::int4)`;
/** @internal Sets {@link tagSql}'s placeholders in `values` for `lock` at `fence`. */
export function addTagValues(values: Record<string, string>, lock: LockIdentity, fence: Fence): void {
  const [tag1, tag2] = registerTag(lock, fence);
  values.tag1 = String(tag1);
  values.tag2 = String(tag2);
}
// The same claim, and the transaction it opens (or joins) may sit idle at most `idle` ms.
// It names its session too, for a transaction to stop if its lease is lost (lost-lease.ts).
// It tags the transaction as the register's sharer too (migration 0009), which a raise reads.
const boundedClaimSql = () =>
  sql`select palisade.claim_lock(${p('kind')}::text, ${p('source')}::text, ${p('namespace')}::text, ${p('name')}::text, ${p('fence')}::int8)::text as registered,
    ${idleBoundSql()} as idle, ${tagSql()} as tagged, ${sessionColumnsSql()}`;

/** @internal The most a claim's or fenced transaction may sit idle for a holder without an expiry estimate. */
export const DEFAULT_IDLE_MS = 60_000;

// The fence at which this process last saw each lock's register claimed (a claim that held). A write
// of that fence then shares the register by its key alone (statements.ts, `Claim`); a wrong guess
// (the register moved, or the claim was on another database or rolled back) writes nothing there
// and falls to the refusal path, which claims.
const claimedAt = new WeakMap<LockIdentity, bigint>();

/** @internal Notes what a claim of `lock` for `fence` found: the register's fence. */
export function noteClaim(lock: LockIdentity, fence: Fence, registered: bigint): void {
  if (registered === fence) claimedAt.set(lock, fence);
  else claimedAt.delete(lock);
}

/** @internal Whether this process last saw `lock`'s register claimed at `fence` (a claim that held). */
export const seenClaimedAt = (lock: LockIdentity, fence: Fence): boolean => claimedAt.get(lock) === fence;

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
export const ranOut = (holder: { readonly expiresAt?: unknown }): boolean => (ttlLeft(holder) ?? 1) < 1;

/**
 * @internal `LeaseLostError` (with the failure as its cause) in place of a failure that says the session
 * ended, for a call whose transaction was bounded to the TTL left of a holder whose TTL has run out by
 * now: the bound ended that session (a process slower than the TTL left between two statements, or a
 * function of the caller's that ran longer). `undefined` for any other failure, which stays as it is —
 * the caller's function's own error too, unless it is palisade's report of the ended session. Only for a
 * failure before the transaction's COMMIT went out: then nothing it wrote is kept. (At the COMMIT the
 * outcome is unknown whatever ended the session: the caller keeps the driver's failure.)
 */
export function endedByIdleBound(err: unknown, lockName: string, fence: Fence): LeaseLostError | undefined {
  const failure = asThrown(err);
  // What the caller's function threw comes out as thrown — a driver's or another library's error is its
  // own — unless it is palisade's report that the session ended (a call of palisade's in it heard it).
  if (failure !== err && !(failure instanceof DatabaseError)) return undefined;
  if (!sessionEnded(failure)) return undefined;
  const why = 'its TTL ran out during the transaction, whose idle bound ended the session';
  return new LeaseLostError(lockName, fence, why, { cause: translateError(failure) });
}

// The register's fence, and whether this database's grants claim it (as claim_lock tells, migration 0009).
const registerFenceSql = () =>
  sql`select (select r.fence from palisade.lock_registers r where r.lock_key = ${p('lkey')}::uuid)::text as registered,
    ${p('kind')}::text in ('postgres', 'advisory') and ${p('source')}::text = (select s.source_id from palisade.fence_sources s) as granted_here`;

/**
 * @internal What a lock-scoped write of a holder whose TTL ran out by its
 * own estimate does instead of opening or bounding a transaction, whose idle
 * bound would be 1 ms and end the session before its next statement (a
 * process resumed after a pause writes before its timers abort the signal):
 * returns the register's fence when a higher fence claimed the lock (read
 * without a lock: the write is `stale`), and otherwise throws
 * `LeaseLostError` — or, as a claim would, {@link FenceNotIssuedError} for a
 * fence above the latest grant of a lock whose grants claim on this
 * database. Nothing is written either way.
 */
export async function afterRanOut(on: Database, lock: LockIdentity, fence: Fence): Promise<Fence> {
  const [row] = await prepared(on, 'palisade.register_fence', registerFenceSql).rows({
    lkey: registerKey(lock),
    kind: lock.kind,
    source: lock.source,
  });
  const registered = int8(row?.registered) ?? 0n;
  if (registered > fence) return registered as Fence;
  if (registered < fence && row?.granted_here === true) throw new FenceNotIssuedError(registered, fence);
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
  const values = claimValues(lock, fence);
  values.idle = String(idleMs);
  addTagValues(values, lock, fence);
  const [row] = await prepared(on, 'palisade.claim_lock_bounded', boundedClaimSql).rows(values);
  return { registered: registeredOf(row, lock, fence), session: sessionOf(row) };
}

// A claim's parameters; callers add theirs by assignment: spreading objects takes a slow clone path in V8,
// on every fenced transaction.
const claimValues = ({ kind, source, namespace, name }: LockIdentity, fence: Fence): Record<string, string> => ({
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
    const values = claimValues(lock, fence);
    values.wait = wait;
    const rows = await prepared(db, 'palisade.claim_lock_within', claimWithinSql).rows(values);
    return registeredOf(rows[0], lock, fence);
  } catch (err) {
    if (sqlStateOf(err) === '55P03') return null;
    throw err;
  }
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
