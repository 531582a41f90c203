import { type SQL, sql } from 'drizzle-orm';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, FenceSourceError, InvalidArgumentError, LeaseLostError } from '../../src/errors.js';
import { postgresLockBackend, postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { drivers, type TestDatabase } from '../support/databases.js';
import {
  aborted,
  expectInvalid,
  expectReleaseWakesWaiter,
  lockWorker,
  pendingFencingTimers,
  ready,
  request,
  resourceRow,
} from '../support/lock-workers.js';
import { killAllWorkers } from '../support/processes.js';
import { scenarioDatabase, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const TWO_53 = 2n ** 53n;
const MAX_FENCE = 2n ** 63n - 1n;

async function lastValue(db: Database): Promise<bigint> {
  const [row] = await execute(db, sql`select last_value::text as v from palisade.fence_seq`);
  return BigInt(String(row?.v));
}

describe.runIf(needs('DATABASE_URL'))('postgres lease backend, real Postgres, separate processes', () => {
  let test: TestDatabase;
  let namespace: string;
  let manager: LockManager;

  beforeEach(async () => {
    test = await scenarioDatabase();
    namespace = uniqueNamespace('pg');
    manager = postgresLockManager({ client: test.db, namespace });
  });
  afterEach(async () => {
    await killAllWorkers();
    await manager.close();
    await test.close();
  });

  it('kill -9 the holder; another process acquires once the TTL has run out by the database clock', async () => {
    const a = lockWorker(test, 'postgres', namespace, { lock: 'job', ttlMs: 1500 });
    const b = lockWorker(test, 'postgres', namespace, { lock: 'job', ttlMs: 5000, waitMs: 30_000 });
    await ready(a, b);
    const fenceA = BigInt(String((await request(a, { cmd: 'acquire' }, 'acquired')).fence));
    const heldByA = await manager.inspect('job');
    expect(heldByA?.fence).toBe(fenceA);
    expect(heldByA?.holder).toBe(`pid ${a.pid}`);
    a.kill();
    await a.exited;

    const got = await request(b, { cmd: 'acquire' }, 'acquired');
    const fenceB = BigInt(String(got.fence));
    expect(fenceB).toBeGreaterThan(fenceA);
    const heldByB = await manager.inspect('job');
    expect(heldByB?.fence).toBe(fenceB);
    // Taken over only once A's lease had expired, by the database's own clock.
    expect((heldByB?.acquiredAt?.getTime() ?? 0) - (heldByA?.acquiredAt?.getTime() ?? 0)).toBeGreaterThanOrEqual(1500);
  });

  it('a holder paused past its TTL comes back to a stale write; the row keeps the new holder’s value', async () => {
    const a = lockWorker(test, 'postgres', namespace, { lock: 'job', ttlMs: 1500 });
    const b = lockWorker(test, 'postgres', namespace, { lock: 'job', ttlMs: 30_000, waitMs: 30_000 });
    await ready(a, b);
    const fenceA = BigInt(String((await request(a, { cmd: 'acquire' }, 'acquired')).fence));
    a.pause();

    const fenceB = BigInt(String((await request(b, { cmd: 'acquire' }, 'acquired')).fence));
    expect(fenceB).toBeGreaterThan(fenceA);
    expect((await request(b, { cmd: 'write', value: 'from B' }, 'write')).status).toBe('applied');

    a.resume();
    const late = await request(a, { cmd: 'write', value: 'from A' }, 'write');
    expect(late.status).toBe('stale');
    expect(late.currentFence).toBe(fenceB.toString());
    expect(await resourceRow(test)).toEqual({ value: 'from B', lastFence: fenceB });
    // Its own deadline tells A too, once it runs again.
    const lost = await a.next((m) => m.event === 'lost');
    expect(String(lost.reason)).toContain('TTL ran out');
  });

  it('autoExtend keeps a short-TTL lease over a job of several TTLs; after kill -9 the lock frees', async () => {
    const a = lockWorker(test, 'postgres', namespace, { lock: 'job', ttlMs: 2000, autoExtend: true });
    await ready(a);
    const fenceA = BigInt(String((await request(a, { cmd: 'acquire' }, 'acquired')).fence));
    await request(a, { cmd: 'hold', ms: 6500 }, 'held');

    const info = await manager.inspect('job');
    expect(info?.fence).toBe(fenceA);
    const [clock] = await execute(test.db, sql`select floor(extract(epoch from clock_timestamp()) * 1000)::text as ms`);
    // The job outlived three TTLs, by the database clock, and the lease is still A's.
    expect(Number(clock?.ms) - (info?.acquiredAt?.getTime() ?? 0)).toBeGreaterThan(3 * 2000);
    expect(a.messages.some((m) => m.event === 'lost')).toBe(false);
    expect(await manager.tryAcquire('job', { ttlMs: 1000 })).toBeNull();

    a.kill();
    await a.exited;
    const next = await manager.acquire('job', { ttlMs: 10_000, waitMs: 30_000 });
    expect(next.fence).toBeGreaterThan(fenceA);
    await next.release();
  });

  it('fences above 2^53 come back exact; at 2^63−1 the sequence refuses instead of wrapping', async () => {
    await test.db.execute(sql.raw(`select setval('palisade.fence_seq', ${TWO_53})`));
    const a = await manager.acquire('big', { ttlMs: 10_000 });
    expect(a.fence).toBe(TWO_53 + 1n); // not representable as a double
    expect((await manager.inspect('big'))?.fence).toBe(TWO_53 + 1n);
    await a.release();

    await test.db.execute(sql.raw(`select setval('palisade.fence_seq', ${MAX_FENCE - 1n})`));
    const top = await manager.acquire('big', { ttlMs: 10_000 });
    expect(top.fence).toBe(MAX_FENCE);
    await top.release();
    const refused = await manager.acquire('big', { ttlMs: 10_000 }).catch((err: unknown) => err);
    expect(refused).toBeInstanceOf(DatabaseError);
    expect((refused as DatabaseError).sqlState).toBe('2200H'); // sequence_generator_limit_exceeded
  });

  it.each([
    ['CACHE 10', 'alter sequence palisade.fence_seq cache 10', /CACHE 10/],
    ['CYCLE', 'alter sequence palisade.fence_seq cycle', /CYCLE/],
    ['UNLOGGED', 'alter sequence palisade.fence_seq set unlogged', /UNLOGGED/],
    ['descending', 'alter sequence palisade.fence_seq increment by -1', /INCREMENT BY -1/],
  ])('an unsafe fence sequence (%s) is refused with FenceSourceError before any grant', async (_, alter, problem) => {
    await test.db.execute(sql.raw(alter));
    const unsafe = postgresLockManager({ client: test.db, namespace });
    const err = await unsafe.acquire('job', { ttlMs: 1000 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(FenceSourceError);
    expect((err as Error).message).toMatch(problem);
    const [row] = await execute(test.db, sql`select count(*)::int as n from palisade.leases`);
    expect(Number(row?.n)).toBe(0);
    await unsafe.close();
  });

  it('acquireAll in opposite orders from two processes never deadlocks', async () => {
    const a = lockWorker(test, 'postgres', namespace, { lock: 'x', ttlMs: 10_000, waitMs: 30_000 });
    const b = lockWorker(test, 'postgres', namespace, { lock: 'x', ttlMs: 10_000, waitMs: 30_000 });
    await ready(a, b);
    const [doneA, doneB] = await Promise.all([
      request(a, { cmd: 'acquireAll', names: ['x', 'y', 'z'], rounds: 15, holdMs: 5 }, 'acquiredAll'),
      request(b, { cmd: 'acquireAll', names: ['z', 'y', 'x'], rounds: 15, holdMs: 5 }, 'acquiredAll'),
    ]);
    expect([doneA.rounds, doneB.rounds]).toEqual([15, 15]);
    for (const name of ['x', 'y', 'z']) expect(await manager.inspect(name)).toBeNull();
  });

  // The manager's own bad-input refusals are the contract's (test/fencing/contract.test.ts); these are the factory's and the lease's.
  it.each(['repeatable read', 'serializable'])(
    'on a database whose default isolation is %s, waiters racing for a released lock all get it within their wait',
    async (isolation) => {
      const url = test.url as string;
      const dbName = new URL(url).pathname.slice(1);
      await test.db.execute(sql.raw(`alter database "${dbName}" set default_transaction_isolation = '${isolation}'`));
      // Each manager on a client of its own, opened after the change: its connections run at that level.
      const clients = Array.from({ length: 6 }, () => postgres(url, { max: 2, onnotice: () => {} }));
      const [first] = clients as [postgres.Sql];
      const managers = clients.map((c) =>
        postgresLockManager({ client: drizzlePostgres(c) as unknown as Database, namespace }),
      );
      try {
        const [level] = await first`show default_transaction_isolation`;
        expect(level?.default_transaction_isolation).toBe(isolation);
        const [owner] = managers as [LockManager];
        const holder = await owner.acquire('contended', { ttlMs: 10_000 });
        const waiters = managers.slice(1).map(async (m) => {
          const lease = await m.acquire('contended', { ttlMs: 5_000, waitMs: 30_000 });
          await new Promise((r) => setTimeout(r, 20));
          await lease.release();
          return lease.fence;
        });
        await new Promise((r) => setTimeout(r, 300));
        await holder.release();
        const fences = await Promise.all(waiters);
        expect(new Set(fences).size).toBe(5);
        for (const f of fences) expect(f).toBeGreaterThan(holder.fence);
      } finally {
        await Promise.all(managers.map((m) => m.close()));
        await Promise.all(clients.map((c) => c.end({ timeout: 5 })));
      }
    },
  );

  it('bad options and a bad extend TTL throw InvalidArgumentError before any query is sent', async () => {
    const queries: string[] = [];
    const client = postgres(test.url as string, { max: 2, onnotice: () => {} });
    const logged = drizzlePostgres(client, { logger: { logQuery: (q) => queries.push(q) } }) as unknown as Database;
    try {
      expect(() => postgresLockManager({ client: logged, namespace: '' })).toThrow(InvalidArgumentError);
      expect(() => postgresLockManager({ client: undefined as unknown as Database, namespace })).toThrow(
        InvalidArgumentError,
      );
      const checked = postgresLockManager({ client: logged, namespace });
      expect(queries).toEqual([]);
      const lease = await checked.acquire('fine', { ttlMs: 10_000 });
      expect(queries.length).toBeGreaterThan(0); // the logger does see queries
      const before = queries.length;
      await expectInvalid([() => lease.extend(0), () => lease.extend(1.5), () => lease.extend(86_400_001)]);
      expect(queries.length).toBe(before);
      await lease.release();
      await checked.close();
    } finally {
      await client.end({ timeout: 5 });
    }
  });

  it('lease.signal aborts when the lease is lost, extend then refuses, and no timer is left after release', async () => {
    const short = await manager.acquire('job', { ttlMs: 300 });
    const reason = await aborted(short.signal);
    expect(reason).toBeInstanceOf(LeaseLostError);
    await expect(short.extend()).rejects.toBeInstanceOf(LeaseLostError);
    const other = await manager.acquire('job', { ttlMs: 10_000, waitMs: 30_000 });
    expect(await short.release()).toBe('lost');
    expect((await manager.inspect('job'))?.fence).toBe(other.fence);
    await other.release();

    const timers = await pendingFencingTimers(async () => {
      const lease = await manager.acquire('watched', { ttlMs: 10_000, autoExtend: true });
      await lease.extend(); // re-arms the deadline
      expect(lease.signal.aborted).toBe(false);
      expect(await lease.release()).toBe('released');
      expect(lease.signal.aborted).toBe(true);
    });
    expect(timers.created).toBeGreaterThanOrEqual(3); // the deadline (twice) and the watchdog were seen
    expect(timers.pending).toEqual([]);
  });
});

// PGlite (embedded, no server needed) always; postgres.js and node-postgres on the real Postgres when configured.
describe.each(drivers)('postgres lease backend in one process on $name', ({ open }) => {
  let test: TestDatabase;
  let db: Database;

  beforeAll(async () => {
    test = await open();
    db = test.db;
    await migrate(db);
  });
  afterAll(async () => {
    await test?.close();
  });

  const exec = (q: SQL) => execute(db, q);

  it('grants, inspects, extends and releases; a busy attempt and a re-sent grant draw no fence', async () => {
    const backend = postgresLockBackend({ client: db, namespace: uniqueNamespace('lite') });
    const a = await backend.grant('job', 'token-a', 10_000, 'worker a');
    expect(a).not.toBeNull();
    const afterGrant = await lastValue(db);
    expect((await backend.grant('job', 'token-a', 10_000, 'worker a'))?.fence).toBe(a?.fence);
    expect(await lastValue(db)).toBe(afterGrant);
    expect(await backend.grant('job', 'token-b', 10_000, null)).toBeNull();
    expect(await lastValue(db)).toBe(afterGrant);

    const info = await backend.inspect('job');
    expect(info).toMatchObject({ name: 'job', holder: 'worker a', fence: a?.fence });
    expect(info?.remainingMs).toBeGreaterThan(0);
    expect(info?.remainingMs).toBeLessThanOrEqual(10_000);
    expect(await backend.extend('job', 'token-b', 10_000)).toBe(false);
    expect(await backend.extend('job', 'token-a', 20_000)).toBe(true);
    expect((await backend.inspect('job'))?.remainingMs).toBeGreaterThan(10_000);
    expect(await backend.release('job', 'token-b')).toBe(false);
    expect(await backend.release('job', 'token-a')).toBe(true);
    expect(await backend.release('job', 'token-a')).toBe(false);
    expect(await backend.inspect('job')).toBeNull();

    const b = await backend.grant('job', 'token-b', 10_000, null);
    expect(b?.fence).toBeGreaterThan(a?.fence ?? 0n);
    await backend.close();
  });

  it('fences above 2^53 come back exact', async () => {
    const manager = postgresLockManager({ client: db, namespace: uniqueNamespace('lite') });
    const floor = (await lastValue(db)) > TWO_53 ? await lastValue(db) : TWO_53;
    await exec(sql.raw(`select setval('palisade.fence_seq', ${floor})`));
    const lease = await manager.acquire('big', { ttlMs: 10_000 });
    expect(lease.fence).toBe(floor + 1n);
    expect((await manager.inspect('big'))?.fence).toBe(floor + 1n);
    await lease.release();
    await manager.close();
  });

  it('an unsafe fence sequence is refused with FenceSourceError', async () => {
    await exec(sql`alter sequence palisade.fence_seq cache 10`);
    try {
      const manager = postgresLockManager({ client: db, namespace: uniqueNamespace('lite') });
      await expect(manager.acquire('job', { ttlMs: 1000 })).rejects.toBeInstanceOf(FenceSourceError);
      await manager.close();
    } finally {
      await exec(sql`alter sequence palisade.fence_seq cache 1`);
    }
    const fixed = postgresLockManager({ client: db, namespace: uniqueNamespace('lite') });
    const lease = await fixed.acquire('job', { ttlMs: 1000 });
    await lease.release();
    await fixed.close();
  });

  it('a waiter is woken by NOTIFY', async () => {
    const namespace = uniqueNamespace('lite');
    const backend = postgresLockBackend({ client: db, namespace });
    const manager = postgresLockManager({ client: db, namespace });
    await expectReleaseWakesWaiter(backend, manager);
    await backend.close();
    await manager.close();
  });
});
