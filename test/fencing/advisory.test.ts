/**
 * The advisory-lock backend on the real Postgres: the scheduler singleton
 * and the fault scenarios with real OS processes,
 * killed, paused, or with their session terminated by the server. Each test
 * has its own database and namespace. PGlite is refused (its advisory locks
 * always succeed), which the last block checks without a server.
 */
import { PGLiteSocketServer } from '@electric-sql/pglite-socket';
import { sql } from 'drizzle-orm';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import postgres from 'postgres';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { FenceSourceError, InvalidArgumentError, LeaseLostError, PalisadeError } from '../../src/errors.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { advisoryKey, advisoryKeyParts } from '../../src/fencing/backends/postgres-advisory/keys.js';
import { runIfLeader } from '../../src/fencing/backends/postgres-advisory/leader.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import type { TestDatabase } from '../support/databases.js';
import {
  aborted,
  eventually,
  expectInvalid,
  lockWorker,
  pendingFencingTimers,
  ready,
  request,
  resourceRow,
} from '../support/lock-workers.js';
import { newPglite } from '../support/pglite.js';
import { killAllWorkers, type Message } from '../support/processes.js';
import { scenarioDatabase, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const TWO_53 = 2n ** 53n;

describe.runIf(needs('DATABASE_URL'))('advisory backend, real Postgres', () => {
  let test: TestDatabase;
  let namespace: string;
  let client: postgres.Sql;
  let manager: LockManager;

  beforeEach(async () => {
    test = await scenarioDatabase();
    namespace = uniqueNamespace('adv');
    client = postgres(test.url as string, { max: 4, onnotice: () => {} });
    manager = advisoryLockManager({ client: client, namespace });
  });
  afterEach(async () => {
    await killAllWorkers();
    await manager.close();
    await client.end({ timeout: 5 });
    await test.close();
  });

  /** Server pids of the sessions holding `name`'s advisory lock in this test's database. */
  async function holderPids(name: string): Promise<number[]> {
    const { classid, objid } = advisoryKeyParts(advisoryKey(namespace, name));
    const rows = await execute(
      test.db,
      sql`select pid from pg_locks where locktype = 'advisory' and granted and objsubid = 1
          and classid = ${classid.toString()}::oid and objid = ${objid.toString()}::oid`,
    );
    return rows.map((row) => Number(row.pid));
  }

  async function sessionExists(pid: number): Promise<boolean> {
    const [row] = await execute(test.db, sql`select count(*)::int as n from pg_stat_activity where pid = ${pid}`);
    return Number(row?.n) > 0;
  }

  async function terminate(pid: number): Promise<void> {
    const [row] = await execute(test.db, sql`select pg_terminate_backend(${pid}) as done`);
    expect(row?.done).toBe(true);
  }

  it('autoExtend holds over several TTLs; kill -9 frees the lock as soon as the session ends', async () => {
    const a = lockWorker(test, 'advisory', namespace, { lock: 'job', ttlMs: 2000, autoExtend: true });
    await ready(a);
    const fenceA = BigInt(String((await request(a, { cmd: 'acquire' }, 'acquired')).fence));
    // Without extensions the server would end A's idle session after 2 s (idle_session_timeout = TTL).
    await request(a, { cmd: 'hold', ms: 6500 }, 'held');
    expect(a.messages.some((m) => m.event === 'lost')).toBe(false);
    expect((await manager.inspect('job'))?.fence).toBe(fenceA);
    const [pid] = await holderPids('job');
    expect(pid).toBeDefined();

    a.kill();
    await a.exited;
    expect(await eventually(async () => !(await sessionExists(pid as number)))).toBe(true);
    // No TTL to wait out: the lock went with the session.
    const next = await manager.tryAcquire('job', { ttlMs: 10_000 });
    expect(next).not.toBeNull();
    expect(next?.fence).toBeGreaterThan(fenceA);
    await next?.release();
  });

  it('the holder’s session is terminated — its signal fires, the next holder has a higher fence, its late write is stale', async () => {
    const a = lockWorker(test, 'advisory', namespace, { lock: 'job', ttlMs: 5000, autoExtend: true });
    const b = lockWorker(test, 'advisory', namespace, { lock: 'job', ttlMs: 30_000, waitMs: 30_000 });
    await ready(a, b);
    const fenceA = BigInt(String((await request(a, { cmd: 'acquire' }, 'acquired')).fence));
    const pids = await holderPids('job');
    expect(pids).toHaveLength(1);
    await terminate(pids[0] as number);

    const lost = await a.next((m) => m.event === 'lost');
    expect(String(lost.reason)).toContain('connection dropped');
    const fenceB = BigInt(String((await request(b, { cmd: 'acquire' }, 'acquired')).fence));
    expect(fenceB).toBeGreaterThan(fenceA);
    expect((await request(b, { cmd: 'write', value: 'from B' }, 'write')).status).toBe('applied');

    const late = await request(a, { cmd: 'write', value: 'from A' }, 'write');
    expect(late.status).toBe('stale');
    expect(late.currentFence).toBe(fenceB.toString());
    expect(await resourceRow(test)).toEqual({ value: 'from B', lastFence: fenceB });
  });

  it('a holder paused past its TTL loses its session to idle_session_timeout; its late write is stale', async () => {
    const a = lockWorker(test, 'advisory', namespace, { lock: 'job', ttlMs: 1500 });
    const b = lockWorker(test, 'advisory', namespace, { lock: 'job', ttlMs: 30_000, waitMs: 30_000 });
    await ready(a, b);
    const fenceA = BigInt(String((await request(a, { cmd: 'acquire' }, 'acquired')).fence));
    a.pause();

    const fenceB = BigInt(String((await request(b, { cmd: 'acquire' }, 'acquired')).fence));
    expect(fenceB).toBeGreaterThan(fenceA);
    expect((await request(b, { cmd: 'write', value: 'from B' }, 'write')).status).toBe('applied');

    a.resume();
    const late = await request(a, { cmd: 'write', value: 'from A' }, 'write');
    expect(late.status).toBe('stale');
    expect(await resourceRow(test)).toEqual({ value: 'from B', lastFence: fenceB });
    await a.next((m) => m.event === 'lost');
    expect((await manager.inspect('job'))?.fence).toBe(fenceB);
  });

  it('two scheduler processes, exactly one runs the job', async () => {
    const schedulers = [0, 1].map(() => lockWorker(test, 'advisory', namespace, { lock: 'nightly', ttlMs: 10_000 }));
    await ready(...schedulers);
    const verdict = (m: Message) => m.event === 'running' || m.event === 'leader' || m.event === 'error';
    for (const s of schedulers) s.send({ cmd: 'leader', gate: 'nightly' });
    // The leader's job waits at its gate until both verdicts are in, so the runs cannot merely follow each other.
    const first = await Promise.all(schedulers.map((s) => s.next(verdict)));
    const runners = schedulers.filter((_, i) => first[i]?.event === 'running');
    const skippers = schedulers.filter((_, i) => first[i]?.event === 'leader');
    expect(runners).toHaveLength(1);
    expect(skippers).toHaveLength(1);
    expect(skippers[0]?.messages.find((m) => m.event === 'leader')?.ran).toBe(false);
    expect((await manager.inspect('nightly'))?.fence).toBe(
      BigInt(String(first.find((m) => m?.event === 'running')?.fence)),
    );

    const leader = runners[0];
    leader?.send({ cmd: 'open', gate: 'nightly' });
    const done = await leader?.next((m) => m.event === 'leader');
    expect(done).toMatchObject({ ran: true, result: `done by ${leader?.pid}` });
    expect(skippers[0]?.messages.some((m) => m.event === 'running')).toBe(false);
    expect(await eventually(async () => (await manager.inspect('nightly')) === null)).toBe(true);
  });

  it('fences above 2^53 come back exact, from the grant and from inspect', async () => {
    await test.db.execute(sql.raw(`select setval('palisade.fence_seq', ${TWO_53})`));
    const lease = await manager.acquire('big', { ttlMs: 10_000 });
    expect(lease.fence).toBe(TWO_53 + 1n);
    expect((await manager.inspect('big'))?.fence).toBe(TWO_53 + 1n);
    await lease.release();
  });

  it.each([
    ['CACHE 10', 'alter sequence palisade.fence_seq cache 10'],
    ['UNLOGGED', 'alter sequence palisade.fence_seq set unlogged'],
  ])('an unsafe fence sequence (%s) is refused with FenceSourceError, and no lock is taken', async (_, alter) => {
    await test.db.execute(sql.raw(alter));
    const unsafe = advisoryLockManager({ client: client, namespace });
    await expect(unsafe.acquire('job', { ttlMs: 1000 })).rejects.toBeInstanceOf(FenceSourceError);
    expect(await holderPids('job')).toEqual([]);
    await unsafe.close();
  });

  it('acquireAll in opposite orders from two processes never deadlocks', async () => {
    const a = lockWorker(test, 'advisory', namespace, { lock: 'x', ttlMs: 10_000, waitMs: 30_000 });
    const b = lockWorker(test, 'advisory', namespace, { lock: 'x', ttlMs: 10_000, waitMs: 30_000 });
    await ready(a, b);
    const [doneA, doneB] = await Promise.all([
      request(a, { cmd: 'acquireAll', names: ['x', 'y', 'z'], rounds: 15, holdMs: 5 }, 'acquiredAll'),
      request(b, { cmd: 'acquireAll', names: ['z', 'y', 'x'], rounds: 15, holdMs: 5 }, 'acquiredAll'),
    ]);
    expect([doneA.rounds, doneB.rounds]).toEqual([15, 15]);
    for (const name of ['x', 'y', 'z']) expect(await holderPids(name)).toEqual([]);
  });

  // The manager's own bad-input refusals are the contract's (test/fencing/contract.test.ts); these are the factory's, runIfLeader's and the lease's.
  it('bad options, runIfLeader input and a bad extend TTL throw InvalidArgumentError before any query is sent', async () => {
    const queries: string[] = [];
    const logged = postgres(test.url as string, {
      max: 2,
      onnotice: () => {},
      debug: (_connection, query) => void queries.push(query),
    });
    try {
      expect(() => advisoryLockManager({ client: logged, namespace: '' })).toThrow(InvalidArgumentError);
      expect(() => advisoryLockManager({ client: logged, namespace, maxIdleSessions: -1 })).toThrow(
        InvalidArgumentError,
      );
      const checked = advisoryLockManager({ client: logged, namespace });
      await expectInvalid([
        () => runIfLeader(checked, '', () => 1, { ttlMs: 1000 }),
        () => runIfLeader(checked, 'fine', () => 1, { ttlMs: 0 }),
        () => runIfLeader(checked, 'fine', undefined as unknown as () => number, { ttlMs: 1000 }),
        () => advisoryKey(namespace, '\udc00'),
      ]);
      expect(queries).toEqual([]);

      const lease = await checked.acquire('fine', { ttlMs: 10_000 });
      expect(queries.length).toBeGreaterThan(0); // lease sessions inherit the client's debug hook
      const before = queries.length;
      await expectInvalid([() => lease.extend(0), () => lease.extend(-1), () => lease.extend(Number.NaN)]);
      expect(queries.length).toBe(before);
      await lease.release();
      await checked.close();
    } finally {
      await logged.end({ timeout: 5 });
    }
  });

  it('lease.signal aborts when the session is terminated; extend refuses, release reports lost; no timer is left', async () => {
    const lease = await manager.acquire('job', { ttlMs: 30_000, autoExtend: true });
    const [pid] = await holderPids('job');
    await terminate(pid as number);
    const reason = await aborted(lease.signal);
    expect(reason).toBeInstanceOf(LeaseLostError);
    expect(String(reason)).toContain('connection dropped');
    await expect(lease.extend()).rejects.toBeInstanceOf(LeaseLostError);
    expect(await lease.release()).toBe('lost');
    const next = await manager.acquire('job', { ttlMs: 10_000, waitMs: 30_000 });
    expect(next.fence).toBeGreaterThan(lease.fence);
    await next.release();

    const timers = await pendingFencingTimers(async () => {
      const watched = await manager.acquire('watched', { ttlMs: 10_000, autoExtend: true });
      await watched.extend();
      expect(watched.signal.aborted).toBe(false);
      expect(await watched.release()).toBe('released');
    });
    expect(timers.created).toBeGreaterThanOrEqual(3);
    expect(timers.pending).toEqual([]);
    expect(await holderPids('watched')).toEqual([]);
  });

  it('runIfLeader: a second caller meanwhile does not run; the lock is released after the job, also when it throws', async () => {
    const other = advisoryLockManager({ client: client, namespace });
    try {
      const outer = await runIfLeader(
        manager,
        'job',
        async (lease) => {
          const inner = await runIfLeader(other, 'job', () => 'should not run', { ttlMs: 1000 });
          return { inner, fence: lease.fence };
        },
        { ttlMs: 10_000 },
      );
      expect(outer.ran).toBe(true);
      expect(outer.ran && outer.result.inner).toEqual({ ran: false });
      expect(await manager.inspect('job')).toBeNull();

      const boom = new Error('job failed');
      await expect(
        runIfLeader(
          other,
          'job',
          () => {
            throw boom;
          },
          { ttlMs: 10_000 },
        ),
      ).rejects.toBe(boom);
      expect(await holderPids('job')).toEqual([]);
      expect((await runIfLeader(manager, 'job', () => 7, { ttlMs: 10_000 })).ran).toBe(true);
    } finally {
      await other.close();
    }
  });

  it('inspect: fence, time and a truncated ASCII holder label; null when free; a foreign holder is reported', async () => {
    expect(await manager.inspect('job')).toBeNull();
    const holder = 'ünïcode scheduler on host-42, a rather long label that cannot fit';
    const lease = await manager.acquire('job', { ttlMs: 10_000, holder });
    const info = await manager.inspect('job');
    expect(info?.fence).toBe(lease.fence);
    expect(info?.remainingMs).toBeNull();
    expect(holder.replace(/[^\x20-\x7e]/g, '?').startsWith(info?.holder ?? '(none)')).toBe(true);
    expect(info?.holder?.length).toBeGreaterThan(10);
    const [clock] = await execute(test.db, sql`select floor(extract(epoch from clock_timestamp()) * 1000)::text as ms`);
    expect(info?.acquiredAt?.getTime()).toBeLessThanOrEqual(Number(clock?.ms));
    await lease.release();
    expect(await manager.inspect('job')).toBeNull();

    const unlabelled = await manager.acquire('anon', { ttlMs: 10_000 });
    expect((await manager.inspect('anon'))?.holder).toBeNull();
    await unlabelled.release();

    // Someone outside palisade holds the same 64-bit key.
    const foreign = await client.reserve();
    try {
      await foreign`select pg_advisory_lock(${advisoryKey(namespace, 'job').toString()}::int8)`;
      const err = await manager.inspect('job').catch((e: unknown) => e);
      expect(err).toBeInstanceOf(PalisadeError);
      expect((err as PalisadeError).code).toBe('foreign_lock');
      expect(await manager.tryAcquire('job', { ttlMs: 1000 })).toBeNull();
      await foreign`select pg_advisory_unlock_all()`;
    } finally {
      foreign.release();
    }
  });

  // A grant takes the lock, then draws its fence and claims the lock's register, then labels its session,
  // all in one statement; the claim waits while a fenced transaction shares the register row. Asked
  // meanwhile, inspect saw a lock without a label and called it foreign — which a scheduler that lost the
  // race reported instead of naming the winner (seen in CI on a loaded machine).
  it('inspect waits out a grant still between its lock and its label, within its call’s time, and names that holder', async () => {
    const first = await manager.acquire('job', { ttlMs: 10_000 });
    // A fenced transaction of the first lease, still running: it shares the register row at its fence.
    const sharer = await client.reserve();
    try {
      await sharer`begin`;
      await sharer`select 1 from palisade.lock_registers
        where kind = 'advisory' and namespace = ${namespace} and name = 'job' for share`;
      await first.release();
      const second = advisoryLockManager({ client: client, namespace });
      try {
        const granting = second.acquire('job', { ttlMs: 10_000, waitMs: 10_000 });
        // The second grant holds the lock and waits on the register row, its session not yet labelled.
        expect(
          await eventually(async () => {
            const [row] = await execute(
              test.db,
              sql`select 1 from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'
                and query like '/* palisade advisory grant */%'`,
            );
            return row !== undefined;
          }),
        ).toBe(true);
        // Within its call's time only: a manager whose calls may take 150 ms gives up on it.
        const impatient = advisoryLockManager({ client: client, namespace, lockTimeoutMs: 50, commandTimeoutMs: 100 });
        try {
          await expect(impatient.inspect('job')).rejects.toMatchObject({ code: 'command_timeout' });
        } finally {
          await impatient.close();
        }
        const inspecting = manager.inspect('job');
        await new Promise((resolve) => setTimeout(resolve, 200));
        await sharer`commit`;
        const [lease, info] = await Promise.all([granting, inspecting]);
        expect(info?.fence).toBe(lease.fence);
        await lease.release();
      } finally {
        await second.close();
      }
    } finally {
      await sharer`rollback`.catch(() => {});
      sharer.release();
    }
  });

  it('close() ends the manager’s sessions: held leases are told they are lost and their locks are free', async () => {
    const closing = advisoryLockManager({ client: client, namespace });
    const lease = await closing.acquire('job', { ttlMs: 30_000 });
    expect(await holderPids('job')).toHaveLength(1);
    await closing.close();
    expect(await aborted(lease.signal)).toBeInstanceOf(LeaseLostError);
    expect(await eventually(async () => (await holderPids('job')).length === 0)).toBe(true);
    expect(await lease.release()).toBe('lost');
    await expect(closing.acquire('job', { ttlMs: 1000 })).rejects.toMatchObject({ code: 'closed' });
  });
});

describe('advisory backend refuses PGlite (its advisory locks always succeed)', () => {
  it('refuses a PGlite instance or a drizzle database, and PGlite served over a socket at first use', async () => {
    const lite = newPglite();
    try {
      const db = drizzlePglite(lite) as unknown as Database;
      for (const wrong of [lite, db, {}, undefined]) {
        expect(() => advisoryLockManager({ client: wrong as unknown as postgres.Sql, namespace: 'n' })).toThrow(
          InvalidArgumentError,
        );
      }

      const server = new PGLiteSocketServer({ db: lite, port: 0, host: '127.0.0.1' });
      await server.start();
      const address = server.getServerConn();
      const viaSocket = postgres(`postgres://postgres@${address}/postgres`, { max: 1, onnotice: () => {} });
      try {
        const manager = advisoryLockManager({ client: viaSocket, namespace: 'n' });
        const err = await manager.acquire('job', { ttlMs: 1000 }).catch((e: unknown) => e);
        expect(err).toBeInstanceOf(PalisadeError);
        expect((err as PalisadeError).code).toBe('unsupported_database');
        await manager.close();
      } finally {
        await viaSocket.end({ timeout: 5 });
        await server.stop();
      }
    } finally {
      await lite.close();
    }
  });
});
