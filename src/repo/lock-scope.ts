/**
 * Lock scope: writes that claim their lock's fence register (README, "Two
 * scopes of fencing"); how they claim it is in register-claim.ts.
 */
import { sql } from 'drizzle-orm';
import { type Database, transaction } from '../driver.js';
import { InvalidArgumentError, LockScopeError } from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { checkLockIdentity, type LockIdentity } from '../fencing/lock-identity.js';
import { prepared } from '../prepared.js';
import type { Claim } from './claim-guard.js';
import { lostError, stopOnAbort } from './lost-lease.js';
import {
  addTagValues,
  afterRanOut,
  claimLockBounded,
  endedByIdleBound,
  idleBound,
  idleBoundSql,
  ranOut,
  seenClaimedAt,
  tagSql,
} from './register-claim.js';
import type { FenceHolder, LeasedRepository } from './repository-api.js';
import { type BatchResult, rejecting, type WriteResult } from './result.js';
import type { Returning } from './statements.js';
import type { FencedTable, KeyOf, PatchOf, RowOf } from './table.js';

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
  const values: Record<string, string> = { idle: String(scope.idleMs()) };
  addTagValues(values, scope.lock, fence);
  await prepared(tx, 'palisade.idle_bound', boundSql).rows(values);
}

/** @internal How a write of `fence` claims `scope`'s lock: shared by key once this process saw that claim hold. */
export const claimOf = (scope: LockScope | undefined, fence: Fence): Claim | undefined =>
  scope && { lock: scope.lock, shared: seenClaimedAt(scope.lock, fence) };

/**
 * Runs `run` in a transaction (a savepoint inside one) that first claims
 * `lock` for `fence`; when a higher fence claimed it, `refused(register, tx)`
 * instead, and nothing is written. `callerRuns`: `run` runs the caller's
 * code (a `modify`'s function), so a transaction of its own — not a
 * savepoint, not PGlite — is stopped if the holder's signal aborts while it
 * runs (lost-lease.ts), and the call rejects with `LeaseLostError`. A holder
 * whose TTL ran out opens no transaction: {@link afterRanOut}; one whose TTL
 * runs out inside it and whose session the idle bound ended rejects with
 * `LeaseLostError` ({@link endedByIdleBound}).
 */
export async function inClaim<R>(
  on: Database,
  scope: LockScope,
  fence: Fence,
  run: (tx: Database) => Promise<R>,
  refused: (registered: Fence, tx: Database) => R | Promise<R>,
  callerRuns = false,
): Promise<R> {
  let stopper: ReturnType<typeof stopOnAbort> | undefined;
  const lost = () => lostError(scope.signal, fence);
  // Set once the function is done and the driver's COMMIT (or savepoint release) is what remains.
  let committing = false;
  try {
    if (scope.ranOut()) return await refused(await afterRanOut(on, scope.lock, fence), on);
    return await transaction(on, async (tx) => {
      const { registered, session } = await claimLockBounded(tx, scope.lock, fence, scope.idleMs());
      noteBounded(tx, scope.lock);
      if (registered !== fence) {
        const refusal = await refused(registered, tx);
        committing = true;
        return refusal;
      }
      if (callerRuns) stopper = stopOnAbort(on, tx, session, [scope.signal], lost);
      let value: R;
      try {
        value = await run(tx);
      } finally {
        stopper?.disarm();
      }
      // Stopped after `run`'s last statement: what it wrote was rolled back, whatever it returned.
      if (stopper?.disarm()) throw lost();
      committing = true;
      return value;
    });
  } catch (err) {
    // Stopped because the lease was lost: that is what the caller needs to hear. So is a session the bound of
    // a TTL that ran out meanwhile ended before the COMMIT went out (nothing kept); at the COMMIT the outcome
    // is unknown, and the driver's failure says so.
    if (stopper?.disarm()) throw lost();
    throw (!committing && scope.ranOut() && endedByIdleBound(err, scope.lock.name, fence)) || err;
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
