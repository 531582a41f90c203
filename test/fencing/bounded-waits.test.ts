/**
 * `waitMs` bounds the Postgres backends on the *server*, not only in the
 * client's promise. A real blocker transaction holds what a grant needs — a
 * row lock on the lease row (an operator's `SELECT … FOR UPDATE`), an
 * ACCESS EXCLUSIVE lock on `palisade.leases` (`VACUUM FULL`, `ALTER
 * TABLE`, `LOCK TABLE`), a lock on `palisade.fence_seq` (`ALTER SEQUENCE`)
 * — while `acquire(name, { waitMs })` runs. The acquire must reject with
 * `LockUnavailableError` while the blocker still holds on, and once the
 * blocker commits no late grant may appear: a statement left waiting on the
 * server after the promise gave up would take the lease row (or the
 * advisory lock) for a token nobody holds. Release, extend and inspect are
 * bounded too (`lockTimeoutMs`), with typed errors.
 *
 * Each case first checks that the acquire really waited on a lock
 * (`pg_stat_activity.wait_event_type = 'Lock'`): a test whose blocker blocks
 * nothing would prove nothing.
 */
import { sql } from 'drizzle-orm';
import postgres from 'postgres';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { execute } from '../../src/driver.js';
import { LeaseLostError, LockTimeoutError, LockUnavailableError } from '../../src/errors.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { advisoryKey, advisoryKeyParts } from '../../src/fencing/backends/postgres-advisory/keys.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

/** How a promise settled within `ms` (a generous bound, never a timing assertion), or that it had not yet. */
async function settleWithin<T>(
  promise: Promise<T>,
  ms: number,
): Promise<{ settled: true; value?: T; error?: unknown } | { settled: false }> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<{ settled: false }>((resolve) => {
    timer = setTimeout(() => resolve({ settled: false }), ms);
  });
  try {
    return await Promise.race([
      promise.then(
        (value) => ({ settled: true as const, value }),
        (error: unknown) => ({ settled: true as const, error }),
      ),
      late,
    ]);
  } finally {
    clearTimeout(timer);
  }
}

describe.runIf(needs('DATABASE_URL'))('Postgres backends: waits are bounded on the server', () => {
  let test: TestDatabase;
  let client: postgres.Sql;
  let blockerClient: postgres.Sql;
  let blocker: postgres.ReservedSql;
  let blockerPid: number;
  let namespace: string;
  const managers: LockManager[] = [];

  beforeEach(async () => {
    test = await postgresDatabase();
    await migrate(test.db);
    client = postgres(test.url as string, { max: 4, onnotice: () => {} });
    blockerClient = postgres(test.url as string, { max: 1, onnotice: () => {} });
    blocker = await blockerClient.reserve();
    const [row] = await blocker.unsafe('select pg_backend_pid() as pid');
    blockerPid = Number(row?.pid);
    namespace = uniqueNamespace('bounded');
  });
  afterEach(async () => {
    await blocker?.unsafe('rollback').catch(() => {});
    blocker?.release();
    for (const m of managers.splice(0)) await m.close();
    await blockerClient?.end({ timeout: 5 });
    await client?.end({ timeout: 5 });
    await test?.close();
  });

  function leases(options: { lockTimeoutMs?: number } = {}): LockManager {
    const manager = postgresLockManager({ client: test.db, namespace, ...options });
    managers.push(manager);
    return manager;
  }

  /** Whether some session other than the blocker waits on a heavyweight lock in this database (bounded poll). */
  async function sawLockWait(): Promise<boolean> {
    for (let i = 0; i < 100; i++) {
      const [row] = await client.unsafe(
        `select count(*)::int as n from pg_stat_activity
         where datname = current_database() and wait_event_type = 'Lock' and pid <> $1`,
        [blockerPid],
      );
      if (Number(row?.n) > 0) return true;
      await new Promise((r) => setTimeout(r, 10));
    }
    return false;
  }

  /** Waits (bounded) until no other session of this database is running a statement. */
  async function quiet(): Promise<void> {
    for (let i = 0; i < 200; i++) {
      const [row] = await client.unsafe(
        `select count(*)::int as n from pg_stat_activity
         where datname = current_database() and state = 'active' and pid <> pg_backend_pid()`,
      );
      if (Number(row?.n) === 0) return;
      await new Promise((r) => setTimeout(r, 25));
    }
    throw new Error('the database did not go quiet');
  }

  /**
   * Runs `acquire` while the blocker holds its lock: it must reject with
   * LockUnavailableError before the blocker lets go (within a generous 20 s,
   * against a waitMs of 1.5 s). Then the blocker commits, and whatever the
   * acquire did, its lease (if any) is released.
   */
  async function acquireWhileBlocked(acquire: () => Promise<{ release(): Promise<unknown> }>) {
    const attempt = acquire();
    attempt.catch(() => {}); // examined below; it may reject before anyone awaits it
    const waited = await sawLockWait();
    const early = await settleWithin(attempt, 20_000);
    await blocker.unsafe('commit');
    const outcome = await attempt.then(
      async (lease) => {
        await lease.release();
        return lease;
      },
      (error: unknown) => error,
    );
    return { waited, early, outcome };
  }

  const leaseBlockers: [string, (name: string) => Promise<void>][] = [
    [
      'a row lock on the lease row (SELECT … FOR UPDATE)',
      async (name) => {
        await blocker.unsafe('begin');
        await blocker.unsafe('select 1 from palisade.leases where namespace = $1 and name = $2 for update', [
          namespace,
          name,
        ]);
      },
    ],
    [
      'an ACCESS EXCLUSIVE lock on palisade.leases (VACUUM FULL, ALTER TABLE)',
      async () => {
        await blocker.unsafe('begin');
        await blocker.unsafe('lock table palisade.leases in access exclusive mode');
      },
    ],
  ];

  it.each(leaseBlockers)(
    'lease backend, blocked by %s: acquire rejects within waitMs, and no late grant appears',
    async (_label, block) => {
      const locks = leases();
      // The lock's row exists (released), as it does for every lock used before.
      await (await locks.acquire('job', { ttlMs: 60_000 })).release();
      await block('job');

      const { waited, early, outcome } = await acquireWhileBlocked(() =>
        locks.acquire('job', { ttlMs: 60_000, waitMs: 1500, holder: 'abandoned' }),
      );
      expect(waited).toBe(true);
      expect(early.settled).toBe(true);
      expect(outcome).toBeInstanceOf(LockUnavailableError);
      expect(outcome).toMatchObject({ code: 'lock_unavailable', reason: 'timeout' });

      // The blocker has committed: a statement left waiting on the server would run now.
      await quiet();
      const rows = await execute(
        test.db,
        sql`select token, holder from palisade.leases where namespace = ${namespace} and name = 'job'`,
      );
      expect(rows).toEqual([{ token: '', holder: null }]);
      expect(await locks.inspect('job')).toBeNull();
      const next = await locks.tryAcquire('job', { ttlMs: 60_000 });
      expect(next).not.toBeNull();
      await next?.release();
    },
  );

  it('lease backend: tryAcquire on a blocked lease table answers null at once instead of waiting', async () => {
    const locks = leases();
    await blocker.unsafe('begin');
    await blocker.unsafe('lock table palisade.leases in access exclusive mode');
    const { early, outcome } = await acquireWhileBlocked(async () => {
      const lease = await locks.tryAcquire('job', { ttlMs: 60_000 });
      if (lease) return lease;
      throw new LockUnavailableError('job', 'timeout');
    });
    expect(early.settled).toBe(true);
    expect(outcome).toBeInstanceOf(LockUnavailableError);
    await quiet();
    expect(await locks.inspect('job')).toBeNull();
  });

  it('lease backend: inspect, extend and release are bounded by lockTimeoutMs, with typed errors', async () => {
    const locks = leases({ lockTimeoutMs: 300 });
    const lease = await locks.acquire('held', { ttlMs: 60_000 });
    await blocker.unsafe('begin');
    await blocker.unsafe('lock table palisade.leases in access exclusive mode');

    const inspected = await settleWithin(locks.inspect('held'), 20_000);
    expect(inspected.settled).toBe(true);
    const inspectError = inspected.settled ? inspected.error : undefined;
    expect(inspectError).toBeInstanceOf(LockTimeoutError);
    expect(inspectError).toMatchObject({ code: 'lock_timeout', operation: 'inspect', lockName: 'held' });

    // An unconfirmed extension is presumed lost: the lease's signal aborts.
    const extended = await settleWithin(lease.extend(), 20_000);
    expect(extended.settled).toBe(true);
    expect(extended.settled ? extended.error : undefined).toBeInstanceOf(LeaseLostError);
    expect(lease.signal.aborted).toBe(true);

    // release() never throws: one that gave up is 'lost', and a `lost` event says why.
    const lost: string[] = [];
    locks.events.on('lost', (event) => lost.push(event.reason));
    const released = await settleWithin(lease.release(), 20_000);
    expect(released.settled).toBe(true);
    expect(released.settled ? released.value : undefined).toBe('lost');
    expect(lost).toEqual([]); // the lease was already lost (the extension gave up): nothing new to report
    await blocker.unsafe('commit');
  });

  // A fresh manager reads the database's fence source id before its first grant: a lock an operator
  // holds on palisade.fence_sources bounds that read like the grant itself.
  it.each(['lease', 'advisory'])(
    '%s backend, a fresh manager blocked by an ACCESS EXCLUSIVE lock on palisade.fence_sources: tryAcquire answers null, acquire rejects within waitMs, no late grant',
    async (kind) => {
      const fresh = () => {
        const manager =
          kind === 'lease'
            ? postgresLockManager({ client: test.db, namespace })
            : advisoryLockManager({ client, namespace });
        managers.push(manager);
        return manager;
      };
      await blocker.unsafe('begin');
      await blocker.unsafe('lock table palisade.fence_sources in access exclusive mode');
      const tried = await settleWithin(fresh().tryAcquire('job', { ttlMs: 60_000 }), 20_000);
      expect(tried.settled).toBe(true);
      expect(tried.settled ? tried.value : undefined).toBeNull();
      // The first read is shared by a manager's concurrent first grants: one that joins a longer
      // wait's read still answers by its own wait.
      const patient = fresh();
      const long = patient.acquire('other', { ttlMs: 60_000, waitMs: 60_000 });
      long.catch(() => {});
      const joined = await settleWithin(patient.tryAcquire('job', { ttlMs: 60_000 }), 20_000);
      expect(joined.settled).toBe(true);
      expect(joined.settled ? joined.value : undefined).toBeNull();

      const locks = fresh();
      const { waited, early, outcome } = await acquireWhileBlocked(() =>
        locks.acquire('job', { ttlMs: 60_000, waitMs: 1500 }),
      );
      expect(waited).toBe(true);
      expect(early.settled).toBe(true);
      expect(outcome).toMatchObject({ code: 'lock_unavailable', reason: 'timeout' });

      await quiet();
      expect(await locks.inspect('job')).toBeNull();
      const next = await locks.tryAcquire('job', { ttlMs: 60_000 });
      expect(next).not.toBeNull();
      await next?.release();
      await (await long).release(); // the blocker has committed: the patient acquire got its lock
    },
  );

  describe('advisory backend', () => {
    function advisory(): LockManager {
      const manager = advisoryLockManager({ client: client, namespace });
      managers.push(manager);
      return manager;
    }

    async function advisoryHolders(name: string): Promise<number> {
      const { classid, objid } = advisoryKeyParts(advisoryKey(namespace, name));
      const [row] = await client.unsafe(
        `select count(*)::int as n from pg_locks where locktype = 'advisory' and granted and objsubid = 1
           and classid = $1::oid and objid = $2::oid`,
        [classid.toString(), objid.toString()],
      );
      return Number(row?.n);
    }

    it('blocked by a lock on palisade.fence_seq (ALTER SEQUENCE): acquire rejects within waitMs, no late grant', async () => {
      const locks = advisory();
      await (await locks.acquire('job', { ttlMs: 60_000 })).release(); // the one-time checks are done
      await blocker.unsafe('begin');
      await blocker.unsafe('alter sequence palisade.fence_seq cache 1');

      const { waited, early, outcome } = await acquireWhileBlocked(() =>
        locks.acquire('job', { ttlMs: 60_000, waitMs: 1500 }),
      );
      expect(waited).toBe(true);
      expect(early.settled).toBe(true);
      expect(outcome).toBeInstanceOf(LockUnavailableError);

      await quiet();
      expect(await advisoryHolders('job')).toBe(0);
      const next = await locks.tryAcquire('job', { ttlMs: 60_000 });
      expect(next).not.toBeNull();
      expect(await advisoryHolders('job')).toBe(1);
      await next?.release();
    });

    it('held by another session: acquire rejects within waitMs (a try-lock never waits)', async () => {
      const locks = advisory();
      await blocker.unsafe('select pg_advisory_lock($1::int8)', [advisoryKey(namespace, 'job').toString()]);
      const outcome = await settleWithin(locks.acquire('job', { ttlMs: 60_000, waitMs: 300 }), 20_000);
      expect(outcome.settled).toBe(true);
      expect(outcome.settled ? outcome.error : undefined).toBeInstanceOf(LockUnavailableError);
      await blocker.unsafe('select pg_advisory_unlock($1::int8)', [advisoryKey(namespace, 'job').toString()]);
      expect(await advisoryHolders('job')).toBe(0);
    });
  });
});
