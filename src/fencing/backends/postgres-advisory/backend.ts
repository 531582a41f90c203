/**
 * Postgres advisory-lock backend, for scheduler singletons ("run this job
 * on one replica only").
 *
 * Each lease is a session-level `pg_try_advisory_lock(key)` held by a
 * dedicated connection (a *session*) for as long as the lease lives; the
 * fence is drawn from `palisade.fence_seq` in the same statement. The key
 * is 64 bits: the first 8 bytes of sha256(namespace NUL name), not
 * `hashtext`'s 32 bits (with 32 bits, ~77k lock names give even odds of two
 * names sharing a lock).
 *
 * The server ends the lease by ending the session, and the session ends
 * when:
 * - the holder releases (`pg_advisory_unlock`; the session is kept for
 *   reuse);
 * - the holder's process dies or its connection drops (Postgres frees a
 *   session's advisory locks when the session ends) — the lease's `signal`
 *   fires as soon as the client sees the socket close;
 * - the session stays idle for `ttlMs`: each grant and extension sets the
 *   session's `idle_session_timeout` to the TTL (Postgres 14+), so a holder
 *   that is paused or hung without a watchdog loses the lock after one TTL,
 *   exactly like a lease — instead of wedging the lock until it resumes.
 *   `extend()` (or `autoExtend`) checks the session still holds the lock
 *   (`pg_locks` for `pg_backend_pid()`) and restarts that timer.
 *
 * Sessions are not taken from the caller's pool: postgres.js `reserve()`
 * gives no notice when a reserved connection drops, and the next query on
 * it crashes the process (postgres.js 3.4). Each session is a one-connection
 * postgres.js client derived from the caller's client options — as
 * postgres.js's own `listen()` does. So every held lease costs one
 * connection on top of the caller's pool (plus `maxIdleSessions` kept for
 * reuse): advisory locks suit a handful of singletons, not millions of
 * locks.
 *
 * **Not behind PgBouncer (or any pooler) in transaction or statement
 * pooling mode.** A session-level advisory lock belongs to the *server*
 * connection. A transaction pooler hands that server connection to another
 * client after each transaction: the lock stays held by a connection that
 * now runs someone else's queries (who can then "re-acquire" it, since
 * advisory locks are re-entrant per session), our unlock and our
 * `pg_locks` check may run on a different server connection that does not
 * hold it, and the lock is not freed when our client dies because the
 * server connection lives on in the pool. Connect directly, or through a
 * pooler in session mode.
 *
 * **Not on PGlite.** PGlite grants every advisory lock (nothing ever blocks
 * there), so this backend refuses it; use the lease backend
 * (`postgresLockManager`) for the embedded default.
 *
 * `inspect()` reads `pg_locks` (the 64-bit key is split into `classid`,
 * the high 32 bits, and `objid`, the low 32 bits, `objsubid = 1`) and the
 * holding session's `application_name`, which the grant sets to
 * `pl:<fence>:<acquired ms>:<holder>`. `application_name` is limited to 63
 * printable ASCII bytes, so the holder label comes back truncated, with
 * other characters as `?`; the fence and time are exact. There is no table
 * to clean up: all of it vanishes with the session.
 */
import { createHash } from 'node:crypto';
import { PgDialect } from 'drizzle-orm/pg-core';
import type postgres from 'postgres';
import { int8, listen, type RawRow, sqlStateOf, translateError } from '../../../driver.js';
import { InvalidArgumentError, PalisadeError } from '../../../errors.js';
import { loadPeer } from '../../../optional.js';
import type { Grant, LockBackend, LockInfo } from '../../backend.js';
import { type Fence, toFence } from '../../fence.js';
import type { Lease } from '../../lease.js';
import { createLockManager, type LockManager } from '../../lock-manager.js';
import {
  type AcquireOptions,
  checkLockName,
  checkNamespace,
  DEFAULT_LOCK_TIMEOUT_MS,
  MAX_WAIT_MS,
  MIN_GRANT_LOCK_WAIT_MS,
  SERVER_WAIT_GRACE_MS,
} from '../../options.js';
import { RELEASE_CHANNEL, ReleaseListener, releasePayload } from '../../release-listener.js';
import { fenceSequenceQuery, judgeFenceSequence } from '../../sequence.js';

/** Options of {@link advisoryLockManager}. */
export interface AdvisoryLockManagerOptions {
  /**
   * A postgres.js client of a real Postgres (14 or later) where `migrate()`
   * has run, connected directly or through a *session*-mode pooler. Lease
   * sessions are new connections with the same settings; the client itself
   * runs only `inspect`, the one-time checks and LISTEN.
   */
  readonly client: postgres.Sql;
  /** Locks are scoped to this string (at most 256 UTF-8 bytes); it is part of the 64-bit key. Fences are shared by every namespace. */
  readonly namespace: string;
  /** Released sessions kept open for the next grant (default 1, at most 16). */
  readonly maxIdleSessions?: number;
  /**
   * The longest a lease session's extend or release waits for a database
   * lock, in ms (the sessions' `lock_timeout`), 1 … 86,400,000; default
   * 5,000. A grant waits at most what is left of the acquire's `waitMs`.
   */
  readonly lockTimeoutMs?: number;
}

/** `pl:<fence>:<ms>:` then `-` (no holder) or `=` and the holder label. */
const LABEL = /^pl:([1-9][0-9]{0,18}):([0-9]{1,16}):(?:-|=(.*))$/s;
const APP_NAME_BYTES = 63;
const IDLE_APP_NAME = 'palisade';

// The lock, the fence, the label and the idle timeout in one statement.
// MATERIALIZED: the try-lock runs exactly once (a second call would take the
// re-entrant lock twice); CASE draws a fence only when the lock was taken.
// The try-lock never waits, but nextval does while another transaction holds
// a lock on the sequence (an ALTER SEQUENCE not yet committed): `w` sets this
// attempt's lock_timeout first ($4: what is left of the acquire's wait; the
// sequence is locked when nextval runs, after it), and the last column puts
// the session's own bound back ($5). The grant claims its lock's register in
// the same statement (palisade.register_grant, migration 0005; $6 namespace,
// $7 name), waiting at most the same lock_timeout for a fenced transaction
// that holds it: a timeout there is "not granted", as for the sequence. A statement that fails after the
// try-lock leaves the advisory lock held (advisory locks ignore rollback):
// the session is then ended, which frees it.
const GRANT = `
  with w as materialized (select set_config('lock_timeout', $4::text, false) as lt),
  t as materialized (select pg_try_advisory_lock($1::int8) as got from w),
  f0 as materialized (
    select got, case when got then nextval('palisade.fence_seq') end as fence,
           floor(extract(epoch from clock_timestamp()) * 1000)::int8 as at
    from t
  ),
  f as materialized (
    select got, fence, at,
           case when got then palisade.register_grant('advisory', $6::text, $7::text, fence) end as registered
    from f0
  )
  select got, fence::text as fence,
         case when got then set_config('application_name',
           left('pl:' || fence || ':' || at || ':' || $3::text, ${APP_NAME_BYTES}), false) end as label,
         case when got then set_config('idle_session_timeout', $2::text, false) end as idle,
         set_config('lock_timeout', $5::text, false) as lock_timeout
  from f`;

const EXTEND = `
  with h as materialized (
    select exists (
      select 1 from pg_catalog.pg_locks
      where locktype = 'advisory' and pid = pg_backend_pid()
        and classid = $1::oid and objid = $2::oid and objsubid = 1 and granted
    ) as held
  )
  select held, case when held then set_config('idle_session_timeout', $3::text, false) end as idle from h`;

const RELEASE = `
  with u as materialized (select pg_advisory_unlock($1::int8) as released)
  select released,
         set_config('idle_session_timeout', '0', false) as idle,
         set_config('application_name', '${IDLE_APP_NAME}', false) as app,
         case when released then pg_notify('${RELEASE_CHANNEL}', $2::text)::text end as notified
  from u`;

const INSPECT = `
  select a.application_name as label
  from pg_catalog.pg_locks l
  left join pg_catalog.pg_stat_activity a on a.pid = l.pid
  where l.locktype = 'advisory' and l.granted and l.objsubid = 1
    and l.classid = $1::oid and l.objid = $2::oid
    and l.database = (select oid from pg_catalog.pg_database where datname = current_database())`;

/**
 * The 64-bit advisory-lock key of `name` in `namespace`: the first 8 bytes
 * of sha256(namespace, NUL, NFC name) as a signed bigint, ready for
 * `pg_try_advisory_lock(bigint)`. For operators: find the holding session
 * with `pg_locks` where `classid`/`objid` are {@link advisoryKeyParts}.
 * @throws {InvalidArgumentError} for a bad name or namespace.
 */
export function advisoryKey(namespace: string, name: string): bigint {
  const digest = createHash('sha256')
    .update(`${checkNamespace(namespace)}\u0000${checkLockName(name)}`, 'utf8')
    .digest();
  return digest.readBigInt64BE(0);
}

/** How `pg_locks` shows a bigint advisory key: `classid` = high 32 bits, `objid` = low 32 bits (with `objsubid = 1`). */
export function advisoryKeyParts(key: bigint): { classid: bigint; objid: bigint } {
  const unsigned = BigInt.asUintN(64, key);
  return { classid: unsigned >> 32n, objid: unsigned & 0xffff_ffffn };
}

interface Session {
  readonly client: postgres.Sql;
  dead: boolean;
  ending: boolean;
  /** Aborted when the connection drops while a lease holds this session. */
  lost: AbortController | undefined;
}

interface Held {
  readonly name: string;
  readonly key: bigint;
  readonly session: Session;
  readonly grant: Grant;
}

function isPostgresJs(value: unknown): value is postgres.Sql {
  return (
    typeof value === 'function' &&
    typeof (value as { unsafe?: unknown }).unsafe === 'function' &&
    typeof (value as { options?: unknown }).options === 'object' &&
    (value as { options?: unknown }).options !== null
  );
}

/** The holder label as it fits `application_name`: printable ASCII, truncated with the rest of the label. */
function holderLabel(holder: string | null): string {
  return holder === null ? '-' : `=${holder.replace(/[^\x20-\x7e]/g, '?')}`;
}

/**
 * The advisory backend's primitives (see {@link LockBackend}); most callers
 * want {@link advisoryLockManager}.
 *
 * Guarantees: a grant is one statement on the lease's own session, taking
 * the lock and a fence together (and idempotent per token within this
 * process); the grant's `lost` signal aborts when that session's connection
 * closes; extend answers whether the session still holds the lock; release
 * unlocks only this lease's session. Before the first grant: the fence
 * sequence is checked and PGlite refused.
 *
 * Does not: survive a pooler in transaction mode (see the module notes), or
 * report a server-side TTL (`remainingMs` is `null`).
 * @throws {InvalidArgumentError} unless `sql` is a postgres.js client, for a bad namespace or `maxIdleSessions`.
 */
export function advisoryLockBackend(options: AdvisoryLockManagerOptions): LockBackend {
  if (options === null || typeof options !== 'object' || !isPostgresJs(options.client)) {
    throw new InvalidArgumentError(
      'advisoryLockManager needs { client } with a postgres.js client of a real Postgres server: ' +
        'advisory locks are held by a session, which drizzle databases and PGlite do not expose ' +
        '(and PGlite grants every advisory lock). Use postgresLockManager({ client: db }) there.',
    );
  }
  const sql = options.client;
  const ns = checkNamespace(options.namespace);
  const maxIdle = options.maxIdleSessions ?? 1;
  if (!Number.isInteger(maxIdle) || maxIdle < 0 || maxIdle > 16) {
    throw new InvalidArgumentError('maxIdleSessions must be an integer in 0 … 16');
  }
  const lockTimeoutMs = options.lockTimeoutMs ?? DEFAULT_LOCK_TIMEOUT_MS;
  if (!Number.isInteger(lockTimeoutMs) || lockTimeoutMs < 1 || lockTimeoutMs > MAX_WAIT_MS) {
    throw new InvalidArgumentError(`lockTimeoutMs must be an integer in 1 … ${MAX_WAIT_MS}`);
  }
  const idle: Session[] = [];
  const sessions = new Set<Session>();
  const held = new Map<string, Held>();
  const listener = new ReleaseListener((onPayload) => listen(sql, RELEASE_CHANNEL, onPayload));
  let ready: Promise<void> | undefined;
  let closed = false;
  let factory: typeof postgres | undefined;

  const run = async (client: postgres.Sql, text: string, params: unknown[]): Promise<RawRow[]> => {
    try {
      return (await client.unsafe(text, params as postgres.ParameterOrJSON<never>[])) as unknown as RawRow[];
    } catch (err) {
      throw translateError(err);
    }
  };

  let source = '';
  const ensureReady = (): Promise<void> => {
    ready ??= (async () => {
      // postgres.js is an optional peer: loaded when the first lease needs a session of its own.
      factory ??= (await loadPeer<{ default: typeof postgres }>('postgres', 'advisoryLockManager')).default;
      const [server] = await run(sql, `select version() ~* '(pglite|emscripten)' as embedded`, []);
      if (server?.embedded === true) {
        throw new PalisadeError(
          'unsupported_database',
          'advisory locks need a real Postgres server: this is PGlite, which grants every advisory lock',
        );
      }
      const query = new PgDialect().sqlToQuery(fenceSequenceQuery());
      const [row] = await run(sql, query.sql, query.params);
      judgeFenceSequence(row);
      const [id] = await run(sql, 'select palisade.fence_source_id() as id', []);
      source = String(id?.id);
    })().catch((err: unknown) => {
      ready = undefined;
      throw err;
    });
    return ready;
  };

  const openSession = (): Session => {
    const session: Session = {
      client: undefined as unknown as postgres.Sql,
      dead: false,
      ending: false,
      lost: undefined,
    };
    const parsed = sql.options as unknown as Record<string, unknown> & { connection?: Record<string, unknown> };
    // Parsed options (they carry `shared`) pass through postgres() unchanged: the same server, credentials and TLS.
    (session as { client: postgres.Sql }).client = (factory as typeof postgres)({
      ...parsed,
      max: 1,
      idle_timeout: null,
      max_lifetime: null,
      fetch_types: false,
      onnotice: () => {},
      onclose: () => {
        session.dead = true;
        if (session.ending) return;
        session.lost?.abort(new Error('the lease session’s connection closed'));
        // Never used again: ended, so postgres.js cannot reconnect it behind our back.
        void endSession(session);
      },
      // lock_timeout: extend and release on this session never wait unbounded (grants set their own).
      connection: { ...parsed.connection, application_name: IDLE_APP_NAME, lock_timeout: String(lockTimeoutMs) },
    } as unknown as postgres.Options<Record<string, postgres.PostgresType>>);
    sessions.add(session);
    return session;
  };

  const endSession = async (session: Session): Promise<void> => {
    if (session.ending) return;
    session.ending = true;
    session.dead = true;
    sessions.delete(session);
    const at = idle.indexOf(session);
    if (at >= 0) idle.splice(at, 1);
    await session.client.end({ timeout: 1 }).catch(() => {});
  };

  const recycle = (session: Session): void => {
    session.lost = undefined;
    if (session.dead) return;
    if (!closed && idle.length < maxIdle) idle.push(session);
    else void endSession(session);
  };

  return {
    kind: 'advisory',
    namespace: ns,

    async grant(name, token, ttlMs, holder, grantOptions): Promise<Grant | null> {
      const mine = held.get(token);
      if (mine) return mine.name === name ? mine.grant : null;
      if (closed) throw new PalisadeError('closed', 'this advisory lock manager is closed');
      await ensureReady();
      const key = advisoryKey(ns, name);
      const wait = Math.max(MIN_GRANT_LOCK_WAIT_MS, Math.ceil(grantOptions?.waitMs ?? 0));
      const params = [
        key.toString(),
        String(ttlMs),
        holderLabel(holder),
        String(wait),
        String(lockTimeoutMs),
        ns,
        name,
      ];
      let reused = idle.length > 0;
      let session = idle.pop() ?? openSession();
      let row: RawRow | undefined;
      for (;;) {
        try {
          [row] = await run(session.client, GRANT, params);
          break;
        } catch (err) {
          // An idle session whose connection had closed meanwhile: once more, on a fresh one.
          const retry = reused && session.dead && !closed;
          // The statement may have taken the lock before failing (advisory locks ignore rollback): end the session.
          await endSession(session);
          // lock_timeout while drawing the fence: not granted this time, and the ended session holds nothing.
          if (sqlStateOf(err) === '55P03') return null;
          if (!retry) throw err;
          reused = false;
          session = openSession();
        }
      }
      if (row?.got !== true || session.dead) {
        if (session.dead) await endSession(session);
        else recycle(session);
        return null;
      }
      const lost = new AbortController();
      session.lost = lost;
      const grant: Grant = { fence: toFence(int8(row.fence)), lost: lost.signal, source };
      held.set(token, { name, key, session, grant });
      return grant;
    },

    async extend(name, token, ttlMs) {
      const mine = held.get(token);
      if (!mine || mine.name !== name || mine.session.dead) return false;
      const { classid, objid } = advisoryKeyParts(mine.key);
      const [row] = await run(mine.session.client, EXTEND, [classid.toString(), objid.toString(), String(ttlMs)]);
      return row?.held === true;
    },

    async release(name, token) {
      const mine = held.get(token);
      if (!mine || mine.name !== name) return false;
      held.delete(token);
      const { session } = mine;
      session.lost = undefined;
      if (session.dead) {
        await endSession(session);
        return false;
      }
      let row: RawRow | undefined;
      try {
        [row] = await run(session.client, RELEASE, [mine.key.toString(), releasePayload(ns, name)]);
      } catch {
        // Ending the session frees whatever it holds.
        await endSession(session);
        return false;
      }
      if (row?.released === true) recycle(session);
      else await endSession(session);
      return row?.released === true;
    },

    async inspect(name): Promise<LockInfo | null> {
      const { classid, objid } = advisoryKeyParts(advisoryKey(ns, name));
      // The label is set in the grant's own statement, a moment after the lock: look again briefly.
      for (let attempt = 0; attempt < 3; attempt++) {
        const [row] = await run(sql, INSPECT, [classid.toString(), objid.toString()]);
        if (!row) return null;
        const label = LABEL.exec(String(row.label ?? ''));
        if (label) {
          return {
            name,
            holder: label[3] ?? null,
            fence: toFence(label[1]) as Fence,
            acquiredAt: new Date(Number(label[2])),
            remainingMs: null,
          };
        }
      }
      throw new PalisadeError(
        'foreign_lock',
        'the advisory lock is held by a session that is not a palisade lease (same 64-bit key)',
      );
    },

    waitForRelease(name, ms, signal) {
      return listener.wait(releasePayload(ns, name), ms, signal);
    },

    async close() {
      closed = true;
      // Ending the sessions frees their locks: the leases are lost, and told so.
      for (const { session } of held.values()) session.lost?.abort(new Error('the lock manager was closed'));
      held.clear();
      await listener.close();
      await Promise.all([...sessions].map((session) => endSession(session)));
    },
  };
}

/**
 * A lock manager on Postgres session-level advisory locks, for scheduler
 * singletons: each lease holds its lock on a dedicated connection, with a
 * fence from `palisade.fence_seq` taken in the same statement. Needs a real
 * Postgres 14+ (not PGlite) reached directly or through a session-mode
 * pooler — **never PgBouncer transaction pooling**, which hands the
 * session holding the lock to other clients (see the module notes).
 *
 * Guarantees: at most one session holds a lock; the lock is freed when the
 * holder releases, when its connection drops or its process dies, and when
 * its session stays idle for `ttlMs` (`idle_session_timeout`); the lease's
 * `signal` fires when the client sees the session's connection close, when
 * an extension finds the lock gone, or when `ttlMs` passes unextended; a
 * grant's wait for the fence sequence (locked by an `ALTER SEQUENCE`) ends
 * on the server with what is left of `waitMs`, and the session of a grant
 * that gave up is ended, so it cannot hold the lock later.
 *
 * Does not: make writes safe by itself — a paused holder still believes it
 * leads; write with the lease's fence through a fenced repository. `close()`
 * ends every session of this manager, which frees (and loses) its held
 * leases; the caller's client stays open.
 * @throws {InvalidArgumentError} unless `sql` is a postgres.js client.
 */
export function advisoryLockManager(options: AdvisoryLockManagerOptions): LockManager {
  // The server bounds the grant's lock waits itself (lock_timeout): let its answer arrive.
  return createLockManager(advisoryLockBackend(options), { waitGraceMs: SERVER_WAIT_GRACE_MS });
}

/** What {@link runIfLeader} did: `ran: false` when another process holds the lock. */
export type LeaderRun<T> = { readonly ran: true; readonly result: T } | { readonly ran: false };

/**
 * The scheduler singleton (seed exercise 8): tries the lock once, without
 * waiting; if granted, runs `job(lease)` and always releases, whether the
 * job returns or throws (its error is rethrown). Works with any lock
 * manager; with {@link advisoryLockManager} the lock also frees by itself if
 * this process dies mid-job.
 *
 * Guarantees: `job` runs only while this process holds the lock, and at most
 * once per call. Does not: stop `job` when the lease is lost — watch
 * `lease.signal`, and write with `lease.fence` through a fenced repository
 * so a late write after a loss is refused.
 * @throws {InvalidArgumentError} for a bad name, options or `job`, before any query.
 */
export async function runIfLeader<T>(
  manager: LockManager,
  name: string,
  job: (lease: Lease) => Promise<T> | T,
  options: AcquireOptions,
): Promise<LeaderRun<T>> {
  if (typeof job !== 'function') throw new InvalidArgumentError('runIfLeader needs a job function');
  const lease = await manager.tryAcquire(name, options);
  if (!lease) return { ran: false };
  try {
    return { ran: true, result: await job(lease) };
  } finally {
    await lease.release();
  }
}
