/**
 * Postgres lease backend: one row per lock in `palisade.leases`, fences from
 * `palisade.fence_seq`. The README's "Postgres leases and advisory locks"
 * section is the manual; what follows is why the SQL is shaped as it is.
 *
 * Clock. Expiry is decided by the database only, with `clock_timestamp()`
 * (the time the expression is evaluated), never a client clock. Not
 * `now()`: that is the start of the *transaction*, which in a single
 * autocommit statement is almost the same instant, but inside a caller's
 * long transaction (or while a statement waits for a row lock) lies in the
 * past — a lease would be granted already partly expired, and a waiter would
 * see a lease as still valid after it ran out. With `clock_timestamp()` a
 * lease's server expiry is never earlier than the holder's local estimate
 * (taken before the statement was sent), so the holder's `signal` fires
 * first.
 *
 * Rows are kept after release (token cleared, `expires_at = -infinity`), so
 * after a lock's first grant every later grant is an UPDATE of its row, and
 * the fence is taken from the sequence for the row version it locked (a
 * grant that waited for the row lock re-evaluates its SET list). Hence, for
 * one lock, fences increase in the order the grants commit. Fences are not
 * gapless: an attempt that evaluated `nextval` and then found the row taken
 * by a concurrent grant discards its value (measured: 643 grants reached
 * fence 1,111 under contention) — harmless, fences only need to increase.
 * The table holds one row per lock name ever used.
 */
import { performance } from 'node:perf_hooks';
import { is, type SQL, sql } from 'drizzle-orm';
import { PgDatabase } from 'drizzle-orm/pg-core';
import {
  type Database,
  int8,
  isListenClient,
  isTransaction,
  type ListenClient,
  listen,
  listenClientOf,
  type RawRow,
} from '../../../driver.js';
import { DatabaseError, InvalidArgumentError, LockTimeoutError } from '../../../errors.js';
import { prepared } from '../../../prepared.js';
import { sqlStateOf } from '../../../server-error.js';
import type { Grant, LockBackend, LockInfo } from '../../backend.js';
import { firstGrantChecks, withinMs } from '../../call-deadline.js';
import { type ClaimRegistersOption, checkClaimRegisters, withEagerClaim } from '../../eager-claim.js';
import { toFence } from '../../fence.js';
import { createLockManager, type LockManager } from '../../lock-manager.js';
import {
  checkCommandTimeout,
  checkNamespace,
  DEFAULT_LOCK_TIMEOUT_MS,
  MAX_WAIT_MS,
  MIN_GRANT_LOCK_WAIT_MS,
  POSTGRES_COMMAND_TIMEOUT_MS,
  SERVER_WAIT_GRACE_MS,
} from '../../options.js';
import { RELEASE_CHANNEL, ReleaseListener, releasePayload } from '../../release-listener.js';
import { checkFenceSequence } from '../../sequence.js';
import { databaseSourceId } from '../../source.js';

/** Options of {@link postgresLockManager}. */
export interface PostgresLockManagerOptions {
  /**
   * A drizzle database (postgres-js or PGlite) where `migrate()` has run.
   * The database, not a transaction (refused): a grant made inside an open
   * transaction would be invisible to other processes until it commits.
   */
  readonly client: Database;
  /** Locks and their names are scoped to this string (at most 256 UTF-8 bytes). Fences are shared by every namespace. */
  readonly namespace: string;
  /**
   * Where to LISTEN for release notifications: by default the client under
   * `db` (postgres.js or PGlite); another postgres.js client or PGlite; or
   * `false` to wake waiters by polling only.
   */
  readonly listen?: ListenClient | false;
  /**
   * The longest extend, release and inspect wait for a database lock on
   * `palisade.leases` (an operator's `VACUUM FULL`, `ALTER TABLE`, a row
   * locked `FOR UPDATE`), in ms, 1 … 86,400,000; default 5,000. Enforced by
   * the server (`lock_timeout`). Grants are bounded by the acquire's own
   * `waitMs` instead.
   */
  readonly lockTimeoutMs?: number;
  /**
   * How long a call may take beyond its server-side lock wait before it
   * fails with `CommandTimeoutError` (a connection that stops answering), in
   * ms, 1 … 600,000; default 10,000. A grant or release already sent may
   * still run; a grant that lands after its call failed is given back.
   */
  readonly commandTimeoutMs?: number;
  /**
   * The eager claim at acquire (README, "When each backend claims"): each
   * grant claims its lock's register in `db`, the fenced tables' database when
   * it is not `client`'s (on `client` itself every grant claims already),
   * before `acquire` resolves, so a stale holder is refused on every row
   * before the new holder writes. One statement on `db` per grant. A grant
   * that finds a higher fence there is released and the acquire fails with
   * `FenceSourceError`.
   */
  readonly claimRegisters?: ClaimRegistersOption;
}

const p = (name: string) => sql.placeholder(name);
/** Past a grant's lock waits, before its late give-back: the rest of a statement the server runs at once. */
const LATE_GRANT_GRACE_MS = 1_000;

// Each primitive is ONE statement, a call of a function from palisade's
// migration 0002 (drizzle/0002_bounded_lock_waits.sql) that sets
// `lock_timeout` (locally, restored after) and then runs the statement
// itself. The bound cannot be set in the statement that touches
// palisade.leases: that statement's table lock is taken when it is planned,
// before anything in it runs — an ACCESS EXCLUSIVE lock (VACUUM FULL, ALTER
// TABLE) would hold it there unbounded. A function's body is planned and
// locked when it runs, after the set_config. So the wait ends on the server,
// and a grant that gave up cannot take the lock later for a token nobody
// holds.
//
// The grant inserts the lock's first row, or takes over the row if it is
// expired (or released) or already ours (a re-sent grant: same fence); see
// the function for the SQL.
// The source is the id the grant claimed the register under, read in the same statement (migration 0012).
const grantSql = (): SQL => sql`
  select granted_fence as fence, granted_source as source from palisade.lease_grant(${p('ns')}::text, ${p('name')}::text, ${p('token')}::text,
    ${p('holder')}::text, ${p('ttl')}::float8, ${p('wait')}::int)`;

const extendSql = (): SQL => sql`
  select held from palisade.lease_extend(${p('ns')}::text, ${p('name')}::text, ${p('token')}::text,
    ${p('ttl')}::float8, ${p('wait')}::int)`;

// An expired row keeps its token: it behaves like a released one, and
// release reports the lease as lost. Notifies palisade_release (RELEASE_CHANNEL).
const releaseSql = (): SQL => sql`
  select notified from palisade.lease_release(${p('ns')}::text, ${p('name')}::text, ${p('token')}::text,
    ${p('payload')}::text, ${p('wait')}::int)`;

const inspectSql = (): SQL => sql`
  select holder, fence, acquired_ms, remaining_ms from palisade.lease_inspect(${p('ns')}::text, ${p('name')}::text,
    ${p('wait')}::int)`;

/** SQLSTATE 55P03 lock_not_available: `lock_timeout` ended a lock wait; the statement changed nothing. */
const LOCK_NOT_AVAILABLE = '55P03';
/**
 * A database whose default isolation is REPEATABLE READ or SERIALIZABLE
 * runs each statement in a transaction of that level: one racing another
 * grant or release of the same row fails with 40001 (or 40P01) and changed
 * nothing. Not an answer about the lock: the statement is sent again, a
 * few times, each time with a new snapshot.
 */
const CONFLICT_STATES = new Set(['40001', '40P01']);
const CONFLICT_RETRIES = 5;

// No retry once the call has failed on its deadline (`abandoned`): nobody awaits it.
async function retryingConflicts<T>(run: () => Promise<T>, abandoned?: AbortSignal): Promise<T> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await run();
    } catch (err) {
      if (attempt >= CONFLICT_RETRIES || abandoned?.aborted || !CONFLICT_STATES.has(sqlStateOf(err) ?? '')) throw err;
    }
  }
}

/** A drizzle Postgres database (any driver), by class: `{}` or a bare client would fail only at the first grant. */
function isDrizzlePostgres(value: unknown): value is Database {
  if (value === null || typeof value !== 'object' || Object.getPrototypeOf(value) === null) return false;
  try {
    return is(value, PgDatabase);
  } catch {
    return false;
  }
}

/**
 * The Postgres lease backend's primitives (see {@link LockBackend}); most
 * callers want {@link postgresLockManager}. Exposed for tests and for
 * building other managers on the same table.
 *
 * Guarantees: each primitive is one SQL statement; the grant issues a fence
 * above every fence the sequence issued before, in the same statement, and
 * is idempotent per token; release and extend touch only the row of the
 * token that holds the lock and fail once it has expired by the database
 * clock. The fence sequence is checked (`CACHE 1`, logged, `NO CYCLE`)
 * before the first grant.
 *
 * Does not: keep a lease alive by itself (that is the lease's watchdog), or
 * notice a paused holder — expiry does.
 * @throws {InvalidArgumentError} for a bad namespace, a `client` that is not a drizzle Postgres database
 *   (or is a transaction), or a `listen` that is neither `false` nor a client that can LISTEN — at once,
 *   before any query.
 */
export function postgresLockBackend(options: PostgresLockManagerOptions): LockBackend {
  if (options === null || typeof options !== 'object' || !isDrizzlePostgres(options.client)) {
    throw new InvalidArgumentError('postgresLockManager needs { client, namespace } with a drizzle Postgres database');
  }
  if (isTransaction(options.client)) {
    // Its grants would be invisible to every other holder until it commits, and gone if it rolls back.
    throw new InvalidArgumentError('postgresLockManager needs the database as client, not a transaction');
  }
  const db = options.client;
  const ns = checkNamespace(options.namespace);
  if (options.listen !== undefined && options.listen !== false && !isListenClient(options.listen)) {
    // Anything else would fail only at the first wait, and silently: waiters would poll.
    throw new InvalidArgumentError('listen must be false or a client that can LISTEN (postgres.js or PGlite)');
  }
  const lockTimeoutMs = options.lockTimeoutMs ?? DEFAULT_LOCK_TIMEOUT_MS;
  if (!Number.isInteger(lockTimeoutMs) || lockTimeoutMs < 1 || lockTimeoutMs > MAX_WAIT_MS) {
    throw new InvalidArgumentError(`lockTimeoutMs must be an integer in 1 … ${MAX_WAIT_MS}`);
  }
  const commandTimeoutMs = checkCommandTimeout(options.commandTimeoutMs, POSTGRES_COMMAND_TIMEOUT_MS);
  const client = options.listen === false ? undefined : (options.listen ?? listenClientOf(db));
  const listener = new ReleaseListener(client ? (onPayload) => listen(client, RELEASE_CHANNEL, onPayload) : undefined);
  let ready: Promise<void> | undefined;
  let checked = false;

  // The sequence's safety, and that this database has a fence source id, checked once before the first
  // grant (each grant names the id it read itself); a lock on palisade.fence_sources is waited for no
  // longer than the grant would wait.
  const ensureSafeSequence = (lockWaitMs: number): Promise<void> => {
    ready ??= checkFenceSequence(db)
      .then(() => databaseSourceId(db, lockWaitMs))
      .then(() => {
        checked = true;
      })
      .catch((err: unknown) => {
        ready = undefined; // re-check next time: the failure may be transient
        throw err;
      });
    return ready;
  };

  // A statement that hit lock_timeout changed nothing: say so with a typed error. The call as a
  // whole ends at its lock wait plus commandTimeoutMs.
  const bounded = async (
    name: string,
    operation: 'extend' | 'release' | 'inspect',
    run: () => Promise<RawRow[]>,
  ): Promise<RawRow[]> => {
    try {
      return await withinMs(`Postgres lease ${operation}`, lockTimeoutMs + commandTimeoutMs, (abandoned) =>
        retryingConflicts(run, abandoned),
      );
    } catch (err) {
      if (sqlStateOf(err) === LOCK_NOT_AVAILABLE) throw new LockTimeoutError(name, operation, LOCK_NOT_AVAILABLE);
      throw err;
    }
  };

  async function releaseToken(name: string, token: string): Promise<boolean> {
    const payload = releasePayload(ns, name);
    const rows = await bounded(name, 'release', () =>
      prepared(db, 'palisade.leases.release', releaseSql).rows({ ns, name, token, payload, wait: lockTimeoutMs }),
    );
    return rows.length > 0;
  }

  async function grantOnce(
    name: string,
    token: string,
    ttlMs: number,
    holder: string | null,
    wait: number,
    abandoned: AbortSignal,
  ): Promise<Grant | null> {
    // Known once the one-time checks are done: no wrapper on later grants.
    if (!checked && !(await firstGrantChecks('Postgres lease grant', wait, ensureSafeSequence))) return null;
    if (abandoned.aborted) return null; // the call already failed: send no grant nobody awaits
    let rows: RawRow[];
    try {
      rows = await retryingConflicts(
        () => prepared(db, 'palisade.leases.grant', grantSql).rows({ ns, name, token, holder, ttl: ttlMs, wait }),
        abandoned,
      );
    } catch (err) {
      // The row or the table stayed locked past this attempt's wait, or grants kept racing under a
      // stricter isolation: not granted (the acquire retries or gives up).
      const state = sqlStateOf(err);
      if (state === LOCK_NOT_AVAILABLE || CONFLICT_STATES.has(state ?? '')) return null;
      throw err;
    }
    const fence = int8(rows[0]?.fence);
    return fence === null ? null : { fence: toFence(fence), source: String(rows[0]?.source) };
  }

  // Gives `token`'s lease back if a grant still running on the server takes it: tried again and again (the lock
  // stays out of reach no longer than one interval past the grant) until the grant's lock waits — the lease row,
  // the register row, each bounded by `wait` on the server — are surely over, or a try released it.
  function giveBackLater(name: string, token: string, wait: number): void {
    const every = Math.max(250, Math.min(1_000, wait / 4));
    const until = performance.now() + 2 * wait + LATE_GRANT_GRACE_MS;
    const tryOnce = () => {
      void releaseToken(name, token).then(
        (released) => {
          if (!released && performance.now() < until) setTimeout(tryOnce, every).unref();
        },
        () => {
          if (performance.now() < until) setTimeout(tryOnce, every).unref();
        },
      );
    };
    setTimeout(tryOnce, every).unref();
  }

  return {
    kind: 'postgres',
    namespace: ns,

    grant(name, token, ttlMs, holder, grantOptions): Promise<Grant | null> {
      const wait = Math.max(MIN_GRANT_LOCK_WAIT_MS, Math.ceil(grantOptions?.waitMs ?? 0));
      return withinMs(
        'Postgres lease grant',
        wait + commandTimeoutMs,
        (abandoned) => grantOnce(name, token, ttlMs, holder, wait, abandoned),
        // Settled after its call failed: given back now that it is there (or may be: a late failure).
        (late) => {
          if (late !== null) void releaseToken(name, token).catch(() => {});
          if (late === undefined) giveBackLater(name, token, wait);
        },
      ).catch((err: unknown) => {
        // No answer of the server's (the client gave up: node-postgres's query_timeout, a dropped link): the grant
        // may still be running there, past any give-back sent now, and land for a token nobody holds.
        if (err instanceof DatabaseError && err.sqlState === undefined) giveBackLater(name, token, wait);
        throw err;
      });
    },

    async extend(name, token, ttlMs) {
      const rows = await bounded(name, 'extend', () =>
        prepared(db, 'palisade.leases.extend', extendSql).rows({ ns, name, token, ttl: ttlMs, wait: lockTimeoutMs }),
      );
      return rows.length > 0;
    },

    release: (name, token) => releaseToken(name, token),

    async inspect(name): Promise<LockInfo | null> {
      const [row] = await bounded(name, 'inspect', () =>
        prepared(db, 'palisade.leases.inspect', inspectSql).rows({ ns, name, wait: lockTimeoutMs }),
      );
      if (!row) return null;
      return {
        name,
        holder: row.holder === null || row.holder === undefined ? null : String(row.holder),
        fence: toFence(int8(row.fence)),
        acquiredAt: new Date(Number(int8(row.acquired_ms))),
        remainingMs: Number(int8(row.remaining_ms)),
      };
    },

    waitForRelease(name, ms, signal) {
      return listener.wait(releasePayload(ns, name), ms, signal);
    },

    close: () => listener.close(),
  };
}

/**
 * A lock manager on Postgres leases: a row in `palisade.leases` per lock,
 * fences from `palisade.fence_seq` (run `migrate(db)` first). Works on the
 * real Postgres and on PGlite (the embedded default; there, every process
 * must share the one PGlite instance, e.g. over pglite-socket).
 *
 * Guarantees: acquire, extend and release are one statement each; expiry is
 * decided by the database clock; a fence is issued atomically with the
 * grant and, for one lock, fences increase grant after grant; a late
 * release or extend never touches another holder's lease; waiters are woken
 * early by `NOTIFY palisade_release` where the client can LISTEN, and poll
 * otherwise; every wait for a database lock is bounded by the server
 * (`lock_timeout`): a grant by what is left of `waitMs` (at least
 * {@link MIN_GRANT_LOCK_WAIT_MS}), the other calls by `lockTimeoutMs` — so a
 * grant the caller gave up on never lands later. Needs palisade's migration
 * `0002_bounded_lock_waits` (`migrate(db)`).
 *
 * Does not: make writes safe by itself — a paused holder still believes it
 * holds the lock; only the fence, checked by a fenced repository, refuses
 * its late writes. The close() of the manager stops listening but leaves
 * the caller's database client open.
 */
export function postgresLockManager(options: PostgresLockManagerOptions): LockManager {
  // The server bounds the grant's lock waits itself (lock_timeout): let its answer arrive.
  const claim = checkClaimRegisters(options?.claimRegisters);
  return createLockManager(withEagerClaim(postgresLockBackend(options), claim), { waitGraceMs: SERVER_WAIT_GRACE_MS });
}
