/**
 * The Postgres advisory-lock backend, for scheduler singletons: each lease
 * is a session-level `pg_try_advisory_lock` on a dedicated connection, with
 * a fence from `palisade.fence_seq` in the same statement. The README's
 * "Postgres leases and advisory locks" section is the manual (PgBouncer,
 * PGlite, what it guarantees).
 *
 * Sessions are not taken from the caller's pool: postgres.js `reserve()`
 * gives no notice when a reserved connection drops, and the next query on
 * it crashes the process (postgres.js 3.4). Each session is a one-connection
 * client derived from the caller's options, as postgres.js's own `listen()`
 * does. A session idle for `ttlMs` ends by itself (`idle_session_timeout`,
 * set by each grant and extension), so a paused holder loses the lock after
 * one TTL instead of wedging it.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { PgDialect } from 'drizzle-orm/pg-core';
import type postgres from 'postgres';
import { int8, listen, type RawRow, translateError } from '../../../driver.js';
import {
  ForeignLockError,
  InvalidArgumentError,
  LockManagerClosedError,
  LockServiceError,
  UnsupportedDatabaseError,
} from '../../../errors.js';
import { loadPeer } from '../../../optional.js';
import { sqlStateOf } from '../../../server-error.js';
import type { Grant, LockBackend, LockInfo } from '../../backend.js';
import { firstGrantChecks, withinMs } from '../../call-deadline.js';
import { checkClaimRegisters, withEagerClaim } from '../../eager-claim.js';
import { type Fence, toFence } from '../../fence.js';
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
import { fenceSequenceQuery, judgeFenceSequence } from '../../sequence.js';
import { SOURCE_ID_SQL, sourceIdFrom } from '../../source.js';
import { advisoryKey, advisoryKeyParts } from './keys.js';
import { type AdvisoryLockManagerOptions, isPostgresJs } from './options.js';
import { EXTEND, GRANT, holderLabel, IDLE_APP_NAME, INSPECT, LABEL, RELEASE } from './statements.js';

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
 * Does not: survive a pooler in transaction mode (see the README), or
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
  const commandTimeoutMs = checkCommandTimeout(options.commandTimeoutMs, POSTGRES_COMMAND_TIMEOUT_MS);
  // Extend, release and inspect wait at most lockTimeoutMs for a database lock, then commandTimeoutMs more.
  const callMs = lockTimeoutMs + commandTimeoutMs;
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

  let checked = false;
  // The one-time checks: the server, the sequence's safety, and that this database has a fence source id
  // (each grant names the id it read itself). A lock on palisade.fence_sources (an operator's ALTER TABLE)
  // is waited for no longer than the grant would wait.
  const ensureReady = (lockWaitMs: number): Promise<void> => {
    ready ??= (async () => {
      // postgres.js is an optional peer: loaded when the first lease needs a session of its own.
      factory ??= (await loadPeer<{ default: typeof postgres }>('postgres', 'advisoryLockManager')).default;
      const [server] = await run(sql, `select version() ~* '(pglite|emscripten)' as embedded`, []);
      if (server?.embedded === true) {
        throw new UnsupportedDatabaseError(
          'advisory locks need a real Postgres server: this is PGlite, which grants every advisory lock',
        );
      }
      const query = new PgDialect().sqlToQuery(fenceSequenceQuery());
      const [row] = await run(sql, query.sql, query.params);
      judgeFenceSequence(row);
      // In a transaction whose lock_timeout is set first: the function is inlined, and its table
      // locked, when the statement that calls it is planned.
      await sourceIdFrom(
        sql.begin(async (tx) => {
          await tx.unsafe("select set_config('lock_timeout', $1, true)", [String(lockWaitMs)]);
          return (await tx.unsafe(SOURCE_ID_SQL)) as unknown as RawRow[];
        }),
      );
      checked = true;
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
        session.lost?.abort(new LockServiceError('advisory', 'the lease session’s connection closed'));
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

  async function grantOnce(
    name: string,
    token: string,
    ttlMs: number,
    holder: string | null,
    wait: number,
    abandoned: AbortSignal,
  ): Promise<Grant | null> {
    const mine = held.get(token);
    if (mine) return mine.name === name ? mine.grant : null;
    if (closed) throw new LockManagerClosedError('advisory lock manager');
    // Known once the one-time checks are done: no wrapper on later grants.
    if (!checked && !(await firstGrantChecks('Postgres advisory grant', wait, ensureReady))) return null;
    if (abandoned.aborted) return null; // the call already failed: take no session for nobody
    const key = advisoryKey(ns, name);
    const params = [key.toString(), String(ttlMs), holderLabel(holder), String(wait), String(lockTimeoutMs), ns, name];
    let reused = idle.length > 0;
    let session = idle.pop() ?? openSession();
    // The call failed on its deadline: end the session, which frees any lock the grant takes on it.
    const onAbandoned = () => void endSession(session);
    abandoned.addEventListener('abort', onAbandoned, { once: true });
    let row: RawRow | undefined;
    for (;;) {
      try {
        [row] = await run(session.client, GRANT, params);
        break;
      } catch (err) {
        // An idle session whose connection had closed meanwhile: once more, on a fresh one.
        const retry = reused && session.dead && !closed && !abandoned.aborted;
        // The statement may have taken the lock before failing (advisory locks ignore rollback): end the session.
        await endSession(session);
        // lock_timeout while drawing the fence, or (a database whose default isolation is REPEATABLE READ
        // or SERIALIZABLE) the fence source id changed since the statement's snapshot: not granted this
        // time, and the ended session holds nothing.
        const state = sqlStateOf(err);
        if (state === '55P03' || state === '40001') return null;
        if (!retry) throw err;
        reused = false;
        session = openSession();
      }
    }
    abandoned.removeEventListener('abort', onAbandoned);
    if (row?.got !== true || session.dead) {
      if (session.dead) await endSession(session);
      else recycle(session);
      return null;
    }
    const lost = new AbortController();
    session.lost = lost;
    const grant: Grant = { fence: toFence(int8(row.fence)), lost: lost.signal, source: String(row.source) };
    held.set(token, { name, key, session, grant });
    return grant;
  }

  const backend: LockBackend = {
    kind: 'advisory',
    namespace: ns,

    grant(name, token, ttlMs, holder, grantOptions): Promise<Grant | null> {
      const wait = Math.max(MIN_GRANT_LOCK_WAIT_MS, Math.ceil(grantOptions?.waitMs ?? 0));
      return withinMs('Postgres advisory grant', wait + commandTimeoutMs, (abandoned) =>
        grantOnce(name, token, ttlMs, holder, wait, abandoned),
      );
    },

    async extend(name, token, ttlMs) {
      const mine = held.get(token);
      if (!mine || mine.name !== name || mine.session.dead) return false;
      const { classid, objid } = advisoryKeyParts(mine.key);
      const [row] = await withinMs('Postgres advisory extend', callMs, () =>
        run(mine.session.client, EXTEND, [classid.toString(), objid.toString(), String(ttlMs)]),
      );
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
        [row] = await withinMs('Postgres advisory release', callMs, () =>
          run(session.client, RELEASE, [mine.key.toString(), releasePayload(ns, name)]),
        );
      } catch {
        // Ending the session frees whatever it holds.
        await endSession(session);
        return false;
      }
      if (row?.released === true) recycle(session);
      else await endSession(session);
      return row?.released === true;
    },

    inspect(name): Promise<LockInfo | null> {
      const { classid, objid } = advisoryKeyParts(advisoryKey(ns, name));
      // The label is set in the grant's own statement, after the lock, the fence and the register's claim
      // (which may wait): while the holder's session is still in that statement, look again. A lock whose
      // session is anywhere else without the label is not a palisade lease's.
      return withinMs('Postgres advisory inspect', callMs, async (abandoned) => {
        for (let pause = 1; !abandoned.aborted; pause = Math.min(pause * 2, 50)) {
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
          if (row.granting !== true) throw new ForeignLockError(name);
          await sleep(pause);
        }
        return null; // never seen: the call already failed with CommandTimeoutError when `abandoned` fired
      });
    },

    waitForRelease(name, ms, signal) {
      return listener.wait(releasePayload(ns, name), ms, signal);
    },

    async close() {
      closed = true;
      // Ending the sessions frees their locks: the leases are lost, and told so.
      for (const { session } of held.values()) session.lost?.abort(new LockManagerClosedError('advisory lock manager'));
      held.clear();
      await listener.close();
      await Promise.all([...sessions].map((session) => endSession(session)));
    },
  };
  return backend;
}

/**
 * A lock manager on Postgres session-level advisory locks, for scheduler
 * singletons: each lease holds its lock on a dedicated connection, with a
 * fence from `palisade.fence_seq` taken in the same statement. Needs a real
 * Postgres 14+ (not PGlite) reached directly or through a session-mode
 * pooler — **never PgBouncer transaction pooling**, which hands the
 * session holding the lock to other clients (see the README).
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
  const claim = checkClaimRegisters(options?.claimRegisters);
  return createLockManager(withEagerClaim(advisoryLockBackend(options), claim), { waitGraceMs: SERVER_WAIT_GRACE_MS });
}
