import { Cluster } from 'ioredis';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { LockServiceError } from '../../src/errors.js';
import { redisKeyNames, splitRedisFence } from '../../src/fencing/backends/redis/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { Lease } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import type { AcquireOptions } from '../../src/fencing/options.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { TestDatabase } from '../support/databases.js';
import { type ClusterNode, type RedisClusterHandle, startRedisCluster, waitFor } from '../support/redis-cluster.js';
import {
  expectStaleRefusedOnUntouchedRow,
  resource,
  scenarioDatabase,
  scenarioRows,
  uniqueNamespace,
} from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

const hasRedisServer = needs('REDIS_SERVER');

describe.runIf(needs('DATABASE_URL') && hasRedisServer)('Redis lock manager on a real Redis Cluster', () => {
  let rc: RedisClusterHandle;
  let scenario: TestDatabase;
  let client: Cluster;
  const opened: LockManager[] = [];

  beforeAll(async () => {
    [rc, scenario] = await Promise.all([startRedisCluster(), scenarioDatabase()]);
    client = new Cluster(rc.startupNodes, {
      redisOptions: { commandTimeout: 2_000 },
      enableOfflineQueue: false,
      slotsRefreshTimeout: 1_000,
      retryDelayOnFailover: 100,
      clusterRetryStrategy: (times) => Math.min(100 * times, 1_000),
    });
    client.on('error', () => {}); // reconnects by itself; commands fail (bounded) meanwhile
    await waitFor('the cluster client to be ready', 10_000, async () => client.status === 'ready');
  });

  afterEach(async () => {
    for (const m of opened.splice(0)) await m.close();
    // A test that killed or paused nodes leaves the cluster whole (and stable) for the next one.
    if (rc?.nodes.some((n) => !n.running)) await rc.heal();
  });

  afterAll(async () => {
    client?.disconnect();
    await rc?.stop();
    await scenario?.close();
  });

  function manager(namespace: string): LockManager {
    const m = redisLockManager({ client: client, namespace, epochs: scenario.db, commandTimeoutMs: 3_000 });
    opened.push(m);
    return m;
  }

  const { newRow, rowOf } = scenarioRows(() => scenario);
  const repo = () => fencedRepository(scenario.db, resource);
  const write = (row: number, lease: Lease, value: string) => repo().update({ id: row }, lease.fence, { value });

  /** While the cluster reconfigures, commands fail (bounded); the caller retries, bounded in count and time. */
  async function acquireAfterFailover(m: LockManager, name: string, options: AcquireOptions): Promise<Lease> {
    const errors: string[] = [];
    const until = Date.now() + 30_000;
    for (let i = 0; i < 100 && Date.now() < until; i++) {
      try {
        return await m.acquire(name, options);
      } catch (err) {
        errors.push(err instanceof Error ? err.message : String(err));
        await sleep(200);
      }
    }
    throw new Error(`no grant after the failover; last errors: ${errors.slice(-3).join(' | ')}`);
  }

  /** Until the replica acknowledged every write the master took so far (`WAIT 1`), bounded. */
  async function replicated(master: ClusterNode): Promise<void> {
    await waitFor(`a replica of ${master.port} to catch up`, 10_000, async () => {
      return Number(await master.admin().call('WAIT', '1', '500')) >= 1;
    });
  }

  async function promoted(node: ClusterNode): Promise<void> {
    await waitFor(`node ${node.port} to become a master`, 20_000, async () => {
      const role = (await node.admin().call('ROLE')) as unknown[];
      return role[0] === 'master';
    });
  }

  it("keeps a namespace's keys in one slot and spreads namespaces over the masters", async () => {
    const namespaces = Array.from({ length: 12 }, () => uniqueNamespace('rc'));
    const masters = new Set<number>();
    for (const ns of namespaces) {
      const keys = redisKeyNames(ns);
      const slot = await rc.keyslot(keys.fence);
      for (const key of [keys.channel, keys.lock('a'), keys.lock('{other}:x'), keys.lock('é}{')]) {
        expect(await rc.keyslot(key)).toBe(slot);
      }
      masters.add((await rc.masterOf(slot)).port);

      // Every script runs on the namespace's master: a CROSSSLOT key set would fail here.
      const m = manager(ns);
      const a = await m.acquire('a', { ttlMs: 5_000, holder: ns });
      const b = await m.acquire('{other}:x', { ttlMs: 5_000 });
      expect(b.fence).toBeGreaterThan(a.fence);
      expect(await m.inspect('a')).toMatchObject({ holder: ns, fence: a.fence });
      expect(await a.release()).toBe('released');
      expect(await b.release()).toBe('released');
    }
    expect(masters.size).toBeGreaterThanOrEqual(2);
  });

  it('tryAcquire says who holds a lock; a waiter gets it after the release, with a higher fence', async () => {
    const ns = uniqueNamespace('rc');
    const [m1, m2] = [manager(ns), manager(ns)];
    const first = await m1.acquire('x', { ttlMs: 10_000, holder: 'first' });
    expect(await m2.tryAcquire('x', { ttlMs: 10_000 })).toBeNull();
    expect(await m2.inspect('x')).toMatchObject({ holder: 'first', fence: first.fence });
    const waiting = m2.acquire('x', { ttlMs: 10_000, waitMs: 20_000 });
    await sleep(100);
    expect(await first.release()).toBe('released');
    const second = await waiting;
    expect(second.fence).toBeGreaterThan(first.fence);
    await second.release();
  });

  it("failover of the master that owns a namespace's slot: its replica takes over, later fences are higher, the old holder is refused", async () => {
    const ns = uniqueNamespace('rc');
    const keys = redisKeyNames(ns);
    const m = manager(ns);
    const row = await newRow();
    const before = await m.acquire('k', { ttlMs: 3_000 });
    expect((await write(row, before, 'before')).status).toBe('applied');

    const master = await rc.masterOf(await rc.keyslot(keys.fence));
    const replica = await rc.replicaOf(await rc.nodeId(master));
    // The replica has everything: the regression here is the new server identity, not lost writes.
    await replicated(master);
    await master.kill();
    await promoted(replica);

    // `before` still believes it holds the lock; the next holder must get a higher fence.
    const after = await acquireAfterFailover(m, 'k', { ttlMs: 3_000, waitMs: 15_000 });
    expect(after.fence).toBeGreaterThan(before.fence);
    expect(splitRedisFence(after.fence).epoch).toBeGreaterThan(splitRedisFence(before.fence).epoch);
    expect((await write(row, after, 'after')).status).toBe('applied');
    expect(await write(row, before, 'before, late')).toEqual({ status: 'stale', currentFence: after.fence });
    expect(await rowOf(row)).toMatchObject({ value: 'after', lastFence: after.fence });
    await Promise.all([before.release(), after.release()]);
  });

  it('failover to a replica that missed grants (paused and cut off, then CLUSTER FAILOVER TAKEOVER): the counter went back, fences did not', async () => {
    const ns = uniqueNamespace('rc');
    const keys = redisKeyNames(ns);
    const m = manager(ns);
    const row = await newRow();
    const warm = await m.acquire('k', { ttlMs: 5_000 });
    await warm.release();

    const master = await rc.masterOf(await rc.keyslot(keys.fence));
    const replica = await rc.replicaOf(await rc.nodeId(master));
    await replicated(master);
    const [replicatedEpoch, replicatedCounter] = (await master.admin().hmget(keys.fence, 'epoch', 'counter')).map((v) =>
      BigInt(v ?? '0'),
    );

    // The replica is cut off from the replication stream (stopped, and its link closed by the master
    // so that nothing queued in a buffer reaches it later); the master goes on granting.
    replica.pause();
    expect(Number(await master.admin().call('CLIENT', 'KILL', 'TYPE', 'replica'))).toBeGreaterThanOrEqual(1);
    const issued: bigint[] = [warm.fence];
    for (let i = 0; i < 5; i++) {
      const lease = await m.acquire('k', { ttlMs: 5_000 });
      issued.push(lease.fence);
      await lease.release();
    }
    const stale = await m.acquire('k', { ttlMs: 3_000 });
    issued.push(stale.fence);
    expect((await write(row, stale, 'stale holder')).status).toBe('applied');
    expect(splitRedisFence(stale.fence).counter).toBeGreaterThan(replicatedCounter as bigint);

    await master.kill();
    replica.resume();
    await replica.admin().cluster('FAILOVER', 'TAKEOVER');
    await promoted(replica);

    // The premise: the new master's counter is behind fences already issued (same epoch, lower count).
    const [epochNow, counterNow] = (await replica.admin().hmget(keys.fence, 'epoch', 'counter')).map((v) =>
      BigInt(v ?? '0'),
    );
    expect(epochNow).toBe(replicatedEpoch);
    expect(counterNow).toBeLessThan(splitRedisFence(stale.fence).counter);

    const next = await acquireAfterFailover(m, 'k', { ttlMs: 3_000, waitMs: 15_000 });
    for (const fence of issued) expect(next.fence).toBeGreaterThan(fence);
    expect((await write(row, next, 'next')).status).toBe('applied');
    expect(await write(row, stale, 'stale holder, late')).toEqual({ status: 'stale', currentFence: next.fence });
    expect(await rowOf(row)).toMatchObject({ value: 'next', lastFence: next.fence });
    await Promise.all([stale.release(), next.release()]);
  });

  // Resharding: the namespace's slot moves to another master, key by key (CLUSTER SETSLOT … MIGRATING /
  // IMPORTING, MIGRATE, SETSLOT … NODE), as `redis-cli --cluster reshard` does it.
  it("a move of the namespace's slot to another master: grants fail while its keys are split, then take a new epoch; the old holder is refused on every row", async () => {
    const ns = uniqueNamespace('rc');
    const keys = redisKeyNames(ns);
    const m = manager(ns);
    const before = await m.acquire('k', { ttlMs: 1_000, autoExtend: false });

    const slot = await rc.keyslot(keys.fence);
    const from = await rc.masterOf(slot);
    const fromId = await rc.nodeId(from);
    const toView = (await rc.view()).find((n) => n.flags.includes('master') && n.id !== fromId);
    const to = rc.nodes.find((n) => n.port === toView?.port) as ClusterNode;
    const toId = toView?.id as string;
    await to.admin().call('CLUSTER', 'SETSLOT', String(slot), 'IMPORTING', fromId);
    await from.admin().call('CLUSTER', 'SETSLOT', String(slot), 'MIGRATING', toId);
    const migrate = async (names: string[]) => {
      if (names.length > 0)
        await from.admin().call('MIGRATE', '127.0.0.1', String(to.port), '', '0', '5000', 'KEYS', ...names);
    };
    // The fence state moves first; the lock keys stay behind: a grant names keys on both masters.
    await migrate([keys.fence]);
    const split = await m.acquire('other', { ttlMs: 1_000 }).catch((e: unknown) => e);
    expect(split).toBeInstanceOf(LockServiceError); // redirected back and forth until ioredis gave up

    // The rest of the slot, then the slot itself, everywhere.
    for (let i = 0; i < 100; i++) {
      const left = (await from.admin().call('CLUSTER', 'GETKEYSINSLOT', String(slot), '100')) as string[];
      if (left.length === 0) break;
      await migrate(left);
    }
    const masters = (await rc.view()).filter((n) => n.flags.includes('master')).map((n) => n.port);
    for (const node of rc.nodes.filter((n) => masters.includes(n.port))) {
      await node.admin().call('CLUSTER', 'SETSLOT', String(slot), 'NODE', toId);
    }
    await rc.waitStable();

    // The new master's data history is new to the fence state: the next grant takes a new epoch.
    const after = await acquireAfterFailover(m, 'k', { ttlMs: 5_000, waitMs: 10_000 });
    expect(after.fence).toBeGreaterThan(before.fence);
    expect(splitRedisFence(after.fence).epoch).toBeGreaterThan(splitRedisFence(before.fence).epoch);
    expect(await rc.masterOf(slot)).toBe(to);
    await expectStaleRefusedOnUntouchedRow(scenario, before, after);
    await after.release();
  });
});
