/**
 * Fenced transactions: several writes to any fenced tables under one or
 * more leases, all or nothing (README, "Fenced transactions").
 */
import { sql } from 'drizzle-orm';
import { assertSupportedDriver, asThrown, callerCode, type Database, int8, transaction } from '../driver.js';
import {
  DriverError,
  FenceNotIssuedError,
  InvalidArgumentError,
  LeaseLostError,
  LockScopeError,
  StaleFenceError,
} from '../errors.js';
import { assertFence, type Fence } from '../fencing/fence.js';
import { checkLockIdentity, type LockIdentity } from '../fencing/lock-identity.js';
import { prepared } from '../prepared.js';
import { joining, on, type Refusal } from './joined.js';
import { noteBounded } from './lock-scope.js';
import { lostError, type SessionOf, sessionColumnsSql, sessionOf, stopOnAbort } from './lost-lease.js';
import {
  claimLockBounded,
  DEFAULT_IDLE_MS,
  endedByIdleBound,
  idleBoundSql,
  ranOut,
  ttlLeft,
} from './register-claim.js';
import { registerKey, registerTag } from './register-key.js';
import type { FenceHolder } from './repository-api.js';

/** A lease as a fenced transaction needs it: a fence, its signal, its lock and (optionally) its local expiry. */
export interface TransactionLease extends FenceHolder {
  readonly lock?: LockIdentity | undefined;
  /** The lease's expiry estimate on `performance.now()`'s clock (every built-in lease has it). */
  readonly expiresAt?: number;
}

/** Options of {@link fencedTransaction}. */
export interface FencedTransactionOptions {
  /**
   * The most the transaction may sit idle (SQLSTATE 25P03 ends the session
   * after it), in ms. Default and upper bound: the least remaining TTL of the
   * leases (60,000 for holders without `expiresAt`).
   */
  readonly idleTimeoutMs?: number;
}

/**
 * What a fenced transaction did: `applied` with what the function returned,
 * or refused — a lock's register was claimed by a higher fence (then
 * `refusal.table` is `null`), or a write inside was `stale` or `duplicate`
 * (an `updateWhere` that left a row stale too: then `refusal.key` is
 * `null`) — and then nothing it wrote is visible.
 */
export type FencedTransactionResult<R> =
  | { readonly status: 'applied'; readonly value: R }
  | { readonly status: 'stale' | 'duplicate'; readonly refusal: Refusal };

/**
 * Runs `fn(tx)` in one transaction bound to `leases`: first, in one
 * statement and sorted order, it claims every lease's lock register (so two
 * transactions over overlapping locks never deadlock on them) and sets
 * `idle_in_transaction_session_timeout` locally to at most the leases'
 * remaining TTL (not on PGlite: README, "Two scopes of fencing"); then `fn` writes through repositories (on `db` they join
 * `tx`; `with(lease)` or bare fences, each write still fenced per row). If
 * any write inside is refused (`stale` or `duplicate`) the whole
 * transaction rolls back and the result says so; `missing` is left to `fn`.
 *
 * Guarantees: nothing is committed once a higher fence of any of the locks
 * claimed its register before this transaction's claim; a holder paused
 * inside the transaction cannot hold the register past the idle timeout
 * (its session is ended and its commit fails); a lease whose signal aborts
 * while `fn` runs stops the transaction at once (every later statement on
 * `tx` rejects before it is sent, the running one is cancelled from another
 * connection of `db`'s pool, and the transaction is rolled back right
 * after it), so a holder busy inside cannot hold it either, and the call
 * rejects with `LeaseLostError` — unless `db` is a transaction (the
 * outermost owns the session), PGlite or a single node-postgres `Client`.
 * A statement of `fn` that failed aborts the transaction even when its
 * error was caught or never awaited: the call then rejects with that error
 * and nothing is written (README, "Fenced transactions", for the drivers'
 * details) — unless a lease's TTL ran out meanwhile and the idle bound
 * ended the session before the COMMIT went out: then with `LeaseLostError`,
 * that failure its cause (at the COMMIT the outcome is unknown, and the
 * `DatabaseError` says so: its `outcomeUnknown` is true).
 * Does not: retry — a deadlock
 * between tables (40P01) or a serialization failure rejects with
 * `RetryableWriteError`; errors thrown by `fn` roll back and come out as thrown.
 *
 * @throws {LockScopeError} for a lease without `lock`; {@link FenceNotIssuedError}
 * for a fence its lock's grants never issued; `LeaseLostError` when a lease's
 * signal is already aborted (before any query) or aborts while `fn` runs;
 * `InvalidArgumentError` when `db` is a transaction on which another call's
 * savepoint is open (its own savepoint then refuses overlapping calls too).
 */
export async function fencedTransaction<R>(
  db: Database,
  leases: TransactionLease | readonly TransactionLease[],
  fn: (tx: Database) => Promise<R>,
  options: FencedTransactionOptions = {},
): Promise<FencedTransactionResult<R>> {
  assertSupportedDriver(db, 'fencedTransaction');
  const list = checkLeases(leases);
  if (typeof fn !== 'function') throw new InvalidArgumentError('fencedTransaction needs a function');
  // Checked now, before any query (a TTL already out is LeaseLostError); taken again at the claim, after any wait
  // for a connection, so that the bound is the TTL left when the transaction can first sit idle.
  idleTimeout(list, options);
  let refusal: Refusal | undefined;
  let stopper: ReturnType<typeof stopOnAbort> | undefined;
  // Set once the function is done and the driver's COMMIT is what remains.
  let committing = false;
  const parent = on(db);
  const signals = list.map((l) => l.holder.signal);
  const refuse = (r: Refusal): never => {
    refusal = r;
    // Thrown to roll back; the call returns the refusal instead of this error.
    throw new StaleFenceError(r.table ?? '(lock register)', r.key ?? {}, r.attemptedFence, r.currentFence);
  };
  try {
    return await transaction(parent, async (tx) => {
      const { registered: claimed, session } = await claimAll(tx, list, idleTimeout(list, options));
      for (const { lock } of list) noteBounded(tx, lock);
      for (const [i, registered] of claimed.entries()) {
        const { fence } = list[i] as Checked;
        if (registered > fence) {
          refuse({ status: 'stale', table: null, key: null, attemptedFence: fence, currentFence: registered });
        }
      }
      // A lease lost while `fn` runs stops this transaction: a holder busy in here must not keep the
      // register row past its lease (lost-lease.ts; not where `parent` is a transaction, joined or yours).
      stopper = stopOnAbort(parent, tx, session, signals, () => lostOf(list) as Error); // (fired by an abort)
      const refusals: Refusal[] = [];
      let value: R;
      try {
        value = await joining(db, tx, refusals, () => callerCode(() => fn(tx)), parent);
      } finally {
        stopper?.disarm();
      }
      const [refused] = refusals;
      if (refused) refuse(refused);
      const lost = lostOf(list);
      if (lost) throw lost;
      committing = true;
      return { status: 'applied' as const, value };
    });
  } catch (err) {
    if (refusal !== undefined) return { status: refusal.status, refusal };
    // A lease lost: that is what the caller needs to hear — whatever failed once the transaction was
    // stopped for it (the function's own error included), and whatever of palisade's or the driver's
    // failed after (the idle timeout may end the session before the lease's local expiry fires).
    const stopped = stopper?.disarm() ?? false;
    // Not at the COMMIT: a lease lost while it was on its way does not make it fail (the driver's error says
    // whether the outcome is known).
    const lost = !committing && (stopped || asThrown(err) === err) ? lostOf(list) : undefined;
    // A lease whose TTL ran out meanwhile, and the session ended before the COMMIT went out: the idle bound
    // of its TTL left ended it (a call of palisade's in the function may be what heard it). At the COMMIT the
    // outcome is unknown, and the driver's failure says so.
    const outlived = committing ? undefined : list.find((l) => ranOut(l.holder));
    throw lost ?? (outlived && endedByIdleBound(err, outlived.lock.name, outlived.fence)) ?? asThrown(err);
  }
}

// The error of the first lease in `list` whose signal aborted, if one did.
function lostOf(list: readonly Checked[]): Error | undefined {
  const lost = list.find((l) => l.holder.signal.aborted);
  return lost && lostError(lost.holder.signal, lost.fence);
}

/**
 * {@link fencedTransaction} that returns `fn`'s value, and throws
 * `StaleFenceError` (table `(lock register)` when the claim was refused)
 * instead of returning a refusal.
 */
export async function fencedTransactionOrThrow<R>(
  db: Database,
  leases: TransactionLease | readonly TransactionLease[],
  fn: (tx: Database) => Promise<R>,
  options?: FencedTransactionOptions,
): Promise<R> {
  const result = await fencedTransaction(db, leases, fn, options);
  if (result.status === 'applied') return result.value;
  const { table, key, attemptedFence, currentFence } = result.refusal;
  throw new StaleFenceError(table ?? '(lock register)', key ?? {}, attemptedFence, currentFence);
}

const p = (name: string) => sql.placeholder(name);
// Each row names its lock by key, a uuid: text comes back through some drivers changed (PGlite drops a
// leading U+FEFF), and a lease whose row was not recognised was taken for one no higher fence had claimed.
const claimLocksSql = () =>
  sql`select palisade.lock_key(c.kind, c.source, c.namespace, c.name)::text as key, c.fence, c.registered, ${sessionColumnsSql()}
    from (select ${idleBoundSql()}, (select bool_and(pg_try_advisory_xact_lock_shared((t->>0)::int4, (t->>1)::int4))
      from jsonb_array_elements(${p('tags')}::jsonb) t) as tagged) s,
    lateral palisade.claim_locks(${p('claims')}::jsonb) c`;

/**
 * Claims every lease's lock in one statement (one lock: `claim_lock`; more:
 * `claim_locks`, which sorts them) and bounds the transaction's idle time;
 * returns the register's fence per lease, in `list`'s order, and the session.
 * @throws {FenceNotIssuedError} for a fence above its lock's latest grant.
 */
async function claimAll(
  tx: Database,
  list: readonly Checked[],
  idleMs: number,
): Promise<{ registered: bigint[]; session: SessionOf | undefined }> {
  if (list.length === 1) {
    const { lock, fence } = list[0] as Checked;
    const { registered, session } = await claimLockBounded(tx, lock, fence, idleMs);
    return { registered: [registered], session };
  }
  const claims = JSON.stringify(list.map(({ lock, fence }) => ({ ...lock, fence: fence.toString() })));
  const rows = await prepared(tx, 'palisade.claim_locks_bounded', claimLocksSql).rows({
    idle: String(idleMs),
    claims,
    // Each lease's register tag (register-key.ts), as a claim of one lock takes it.
    tags: JSON.stringify(list.map(({ lock, fence }) => registerTag(lock, fence))),
  });
  const registered = new Map<string, bigint>();
  for (const row of rows) {
    const fence = int8(row.fence) ?? 0n;
    const current = int8(row.registered) ?? 0n;
    if (current < fence) throw new FenceNotIssuedError(current, fence);
    registered.set(`${String(row.key)}:${fence}`, current);
  }
  return {
    registered: list.map(({ lock, fence }) => {
      const current = registered.get(`${registerKey(lock)}:${fence}`);
      if (current === undefined) throw new DriverError('the claim of the lock registers returned no row for a lease');
      return current;
    }),
    session: sessionOf(rows[0]),
  };
}

interface Checked {
  readonly holder: TransactionLease;
  readonly fence: Fence;
  readonly lock: LockIdentity;
}

function checkLeases(leases: TransactionLease | readonly TransactionLease[]): Checked[] {
  const list = Array.isArray(leases) ? leases : [leases as TransactionLease];
  if (list.length === 0) throw new InvalidArgumentError('fencedTransaction needs at least one lease');
  return list.map((holder: TransactionLease) => {
    const fence = assertFence(holder?.fence, 'lease fence');
    if (!(holder.signal instanceof AbortSignal)) throw new InvalidArgumentError('lease signal must be an AbortSignal');
    if (holder.lock === undefined || holder.lock === null) {
      throw new LockScopeError('fencedTransaction needs leases with a lock (every built-in lease has one)');
    }
    const lock = checkLockIdentity(holder.lock);
    if (holder.signal.aborted) throw lostError(holder.signal, fence);
    return { holder, fence, lock };
  });
}

function idleTimeout(list: Checked[], options: FencedTransactionOptions): number {
  let ms = DEFAULT_IDLE_MS;
  for (const { holder, fence } of list) {
    if (holder.expiresAt === undefined) continue;
    if (typeof holder.expiresAt !== 'number' || Number.isNaN(holder.expiresAt)) {
      throw new InvalidArgumentError('lease expiresAt must be a number');
    }
    const left = ttlLeft(holder) as number;
    if (left < 1)
      throw new LeaseLostError(holder.lock?.name ?? '(lease)', fence, 'its TTL ran out before the transaction');
    ms = Math.min(ms, left);
  }
  const asked = options.idleTimeoutMs;
  if (asked !== undefined) {
    if (!Number.isSafeInteger(asked) || asked < 1)
      throw new InvalidArgumentError('idleTimeoutMs must be a positive integer');
    ms = Math.min(ms, asked);
  }
  return ms;
}
