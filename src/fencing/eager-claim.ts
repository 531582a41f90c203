/**
 * The eager claim at acquire: a lock manager option for backends whose
 * grants do not claim the lock's register themselves (README, "Two scopes
 * of fencing", "When each backend claims").
 */
import { assertSupportedDriver, type Database, isTransaction } from '../driver.js';
import { FenceSourceError, InvalidArgumentError } from '../errors.js';
import { claimLockWithin } from '../repo/register-claim.js';
import { inStep } from './attempt.js';
import { forwardTo, type Grant, type LockBackend } from './backend.js';
import { withinMs } from './call-deadline.js';
import { checkCommandTimeout, POSTGRES_COMMAND_TIMEOUT_MS } from './options.js';

const CLAIM_STEP = 'the lock register claim on claimRegisters.db';

/** The `claimRegisters` option of the lock managers. */
export interface ClaimRegistersOption {
  /**
   * The database that holds the fenced tables (and palisade's migration
   * 0005): each grant claims its lock's register there before `acquire`
   * resolves. Need not be the database of `epochs` or of the manager.
   */
  readonly db: Database;
  /**
   * How long a claim may go without an answer on the client beyond its wait
   * for the register row, in ms (default 10,000, as the Postgres managers'
   * `commandTimeoutMs`): then `CommandTimeoutError`, and the grant is given
   * back. A connection that stops answering cancels nothing on the server.
   */
  readonly commandTimeoutMs?: number;
}

/** A checked {@link ClaimRegistersOption}. */
interface CheckedClaim {
  readonly db: Database;
  readonly commandTimeoutMs: number;
}

/**
 * @internal Checks a `claimRegisters` option.
 * @throws {InvalidArgumentError} unless it is `{ db }` with a drizzle Postgres database (not a transaction),
 *   and an optional `commandTimeoutMs` in 1 … 600,000.
 */
export function checkClaimRegisters(value: unknown): CheckedClaim | undefined {
  if (value === undefined) return undefined;
  if (value === null || typeof value !== 'object') throw new InvalidArgumentError('claimRegisters must be { db }');
  const { db, commandTimeoutMs } = value as { db?: unknown; commandTimeoutMs?: unknown };
  assertSupportedDriver(db, 'claimRegisters.db');
  // A claim in a transaction would refuse no stale write until it commits, and none if it rolls back.
  if (isTransaction(db)) throw new InvalidArgumentError('claimRegisters.db must be the database, not a transaction');
  return { db, commandTimeoutMs: checkCommandTimeout(commandTimeoutMs, POSTGRES_COMMAND_TIMEOUT_MS) };
}

/**
 * `backend` whose every grant (handed-over ones too) first claims its lock's
 * register on `option.db`, in one statement: from then on every lock-scoped
 * write of a lower fence of the lock is refused, before the new holder
 * writes anything. A grant that finds a higher fence in the register is
 * given back at once and the grant fails with {@link FenceSourceError}: its
 * lease could never write. Without `option`, `backend` as it is.
 * @throws {InvalidArgumentError} when the backend gives its leases no lock (no namespace).
 */
export function withEagerClaim(backend: LockBackend, option: CheckedClaim | undefined): LockBackend {
  if (option === undefined) return backend;
  const namespace = backend.namespace;
  if (namespace === undefined)
    throw new InvalidArgumentError(
      'claimRegisters needs leases with a lock identity (a Redis lock manager gets one only with epochs)',
    );
  // `waitMs`: what is left of the acquire's wait. The claim waits at most half of it for a register row
  // another transaction holds (a holder paused inside a fenced transaction, until its idle bound ends
  // it), so its answer comes before the attempt is cut short at the deadline; then the grant is given
  // back and the lock is busy (`null`) — the next attempt waits half of what is left, and so on.
  const claimed = async (name: string, token: string, grant: Grant, waitMs: number): Promise<Grant | null> => {
    if (grant.source === undefined) return grant;
    const lock = { kind: backend.kind, source: grant.source, namespace, name };
    let registered: bigint | null;
    try {
      // Bounded on the client too, as the Postgres managers' calls are: a stuck connection (a frozen host,
      // a connection pool with no free connection) hung tryAcquire, which no wait cuts short. A claim that
      // lands later claims a fence nobody holds: every later grant's fence is above it.
      // A step of its own: an attempt cut short in it names the claim, not the lock service (which answered).
      registered = await inStep(token, CLAIM_STEP, () =>
        withinMs('Postgres lock register claim', Math.ceil(waitMs / 2) + option.commandTimeoutMs, () =>
          claimLockWithin(option.db, lock, grant.fence, waitMs / 2),
        ),
      );
    } catch (err) {
      // Not claimed, so not handed out: the lock frees now rather than at its TTL.
      await backend.release(name, token).catch(() => {});
      throw err;
    }
    if (registered === null) {
      await backend.release(name, token).catch(() => {});
      return null;
    }
    if (registered === grant.fence) return grant;
    await backend.release(name, token).catch(() => {});
    throw new FenceSourceError(
      'the lock register holds a higher fence than this grant (a newer holder claimed it first, or a forged or reset fence): the grant was released; see `palisade locks registers`',
    );
  };
  const base = forwardTo(backend, namespace);
  const handover = base.waitForTurn;
  return {
    ...base,
    async grant(name, token, ttlMs, holder, options) {
      const grant = await base.grant(name, token, ttlMs, holder, options);
      return grant === null ? null : claimed(name, token, grant, options?.waitMs ?? 0);
    },
    ...(handover
      ? {
          // Never rejects (the contract): a handover whose claim failed was given back, and the
          // waiter's next grant call claims again and reports the failure as a grant does.
          async waitForTurn(...args: Parameters<NonNullable<LockBackend['waitForTurn']>>) {
            const grant = await handover(...args);
            if (grant === undefined) return undefined;
            return (await claimed(args[0], args[3], grant, 0).catch(() => null)) ?? undefined;
          },
        }
      : {}),
  };
}
