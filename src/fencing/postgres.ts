/**
 * Postgres lease backend: one row per lock in `palisade.leases`, fences from
 * `palisade.fence_seq`. Works on the real Postgres (postgres.js) and on
 * PGlite.
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
import { is, type SQL, sql } from 'drizzle-orm';
import { PgDatabase } from 'drizzle-orm/pg-core';
import { type Database, int8, isListenClient, type ListenClient, listen, listenClientOf, prepared } from '../driver.js';
import { InvalidArgumentError } from '../errors.js';
import type { Grant, LockBackend, LockInfo } from './backend.js';
import { toFence } from './fence.js';
import { createLockManager, type LockManager } from './lock-manager.js';
import { checkNamespace, RELEASE_CHANNEL, ReleaseListener, releasePayload } from './release-listener.js';
import { checkFenceSequence } from './sequence.js';

/** Options of {@link postgresLockManager}. */
export interface PostgresLockOptions {
  /**
   * A drizzle database (postgres-js or PGlite) where `migrate()` has run.
   * Pass the database, not a transaction: a grant made inside an open
   * transaction is invisible to other processes until it commits.
   */
  readonly db: Database;
  /** Locks and their names are scoped to this string (at most 256 UTF-8 bytes). Fences are shared by every namespace. */
  readonly namespace: string;
  /**
   * Where to LISTEN for release notifications: by default the client under
   * `db` (postgres.js or PGlite); another postgres.js client or PGlite; or
   * `false` to wake waiters by polling only.
   */
  readonly listen?: ListenClient | false;
}

const p = (name: string) => sql.placeholder(name);
const ttlInterval = sql`(${p('ttl')}::float8 * interval '1 millisecond')`;

// ONE statement: insert the lock's first row, or take over the row if it
// is expired (or released) or already ours (a re-sent grant: same fence).
// The CTEs share one snapshot; ON CONFLICT DO NOTHING and the UPDATE's
// re-check of the locked row settle races with concurrent grants. CASE
// evaluates nextval() only on the branch taken.
const grantSql = (): SQL => sql`
  with inserted as (
    insert into palisade.leases (namespace, name, token, holder, fence, acquired_at, expires_at)
    select ${p('ns')}::text, ${p('name')}::text, ${p('token')}::text, ${p('holder')}::text,
           nextval('palisade.fence_seq'), c.t, c.t + ${ttlInterval}
    from (select clock_timestamp() as t) c
    where not exists (select 1 from palisade.leases where namespace = ${p('ns')}::text and name = ${p('name')}::text)
    on conflict (namespace, name) do nothing
    returning fence
  ), taken as (
    update palisade.leases l set
      fence = case when l.token = ${p('token')}::text then l.fence else nextval('palisade.fence_seq') end,
      acquired_at = case when l.token = ${p('token')}::text then l.acquired_at else clock_timestamp() end,
      token = ${p('token')}::text,
      holder = ${p('holder')}::text,
      expires_at = clock_timestamp() + ${ttlInterval}
    where l.namespace = ${p('ns')}::text and l.name = ${p('name')}::text
      and (l.token = ${p('token')}::text or l.expires_at <= clock_timestamp())
    returning l.fence
  )
  select fence::text as fence from inserted
  union all
  select fence::text as fence from taken`;

const extendSql = (): SQL => sql`
  update palisade.leases set expires_at = clock_timestamp() + ${ttlInterval}
  where namespace = ${p('ns')}::text and name = ${p('name')}::text and token = ${p('token')}::text
    and expires_at > clock_timestamp()
  returning 1 as held`;

// An expired row keeps its token: it behaves like a released one, and
// release reports the lease as lost.
const releaseSql = (): SQL => sql`
  with released as (
    update palisade.leases set token = '', holder = null, expires_at = '-infinity'
    where namespace = ${p('ns')}::text and name = ${p('name')}::text and token = ${p('token')}::text
      and expires_at > clock_timestamp()
    returning 1
  )
  select pg_notify(${sql.raw(`'${RELEASE_CHANNEL}'`)}, ${p('payload')}::text)::text as notified from released`;

const inspectSql = (): SQL => sql`
  select holder, fence::text as fence,
         floor(extract(epoch from acquired_at) * 1000)::int8::text as acquired_ms,
         greatest(0, ceil(extract(epoch from (expires_at - clock_timestamp())) * 1000))::int8::text as remaining_ms
  from palisade.leases
  where namespace = ${p('ns')}::text and name = ${p('name')}::text and expires_at > clock_timestamp()`;

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
 * @throws {InvalidArgumentError} for a bad namespace, a `db` that is not a drizzle Postgres database, or a
 *   `listen` that is neither `false` nor a client that can LISTEN — at once, before any query.
 */
export function postgresLockBackend(options: PostgresLockOptions): LockBackend {
  if (options === null || typeof options !== 'object' || !isDrizzlePostgres(options.db)) {
    throw new InvalidArgumentError('postgresLockManager needs { db, namespace } with a drizzle Postgres database');
  }
  const db = options.db;
  const ns = checkNamespace(options.namespace);
  if (options.listen !== undefined && options.listen !== false && !isListenClient(options.listen)) {
    // Anything else would fail only at the first wait, and silently: waiters would poll.
    throw new InvalidArgumentError('listen must be false or a client that can LISTEN (postgres.js or PGlite)');
  }
  const client = options.listen === false ? undefined : (options.listen ?? listenClientOf(db));
  const listener = new ReleaseListener(client ? (onPayload) => listen(client, RELEASE_CHANNEL, onPayload) : undefined);
  let ready: Promise<void> | undefined;

  const ensureSafeSequence = (): Promise<void> => {
    ready ??= checkFenceSequence(db).catch((err: unknown) => {
      ready = undefined; // re-check next time: the failure may be transient
      throw err;
    });
    return ready;
  };

  return {
    kind: 'postgres',

    async grant(name, token, ttlMs, holder): Promise<Grant | null> {
      await ensureSafeSequence();
      const rows = await prepared(db, 'palisade.leases.grant', grantSql)({ ns, name, token, holder, ttl: ttlMs });
      const fence = int8(rows[0]?.fence);
      return fence === null ? null : { fence: toFence(fence) };
    },

    async extend(name, token, ttlMs) {
      const rows = await prepared(db, 'palisade.leases.extend', extendSql)({ ns, name, token, ttl: ttlMs });
      return rows.length > 0;
    },

    async release(name, token) {
      const payload = releasePayload(ns, name);
      const rows = await prepared(db, 'palisade.leases.release', releaseSql)({ ns, name, token, payload });
      return rows.length > 0;
    },

    async inspect(name): Promise<LockInfo | null> {
      const [row] = await prepared(db, 'palisade.leases.inspect', inspectSql)({ ns, name });
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
 * otherwise.
 *
 * Does not: make writes safe by itself — a paused holder still believes it
 * holds the lock; only the fence, checked by a fenced repository, refuses
 * its late writes. The close() of the manager stops listening but leaves
 * the caller's database client open.
 */
export function postgresLockManager(options: PostgresLockOptions): LockManager {
  return createLockManager(postgresLockBackend(options));
}
