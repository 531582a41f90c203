import type { Redis } from 'ioredis';
import { describe, expect, it, onTestFinished } from 'vitest';
import { FenceSourceError } from '../../src/errors.js';
import { redisKeyNames, splitRedisFence } from '../../src/fencing/backends/redis/backend.js';
import { commandDeadline } from '../../src/fencing/backends/redis/command-deadline.js';
import { GRANT_SCRIPT, runGrant } from '../../src/fencing/backends/redis/scripts/grant.js';
import { scriptRunner } from '../../src/fencing/backends/redis/scripts/script.js';
import { toFence } from '../../src/fencing/fence.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { connect, lockToken, pauseAfter, type RedisScenario, redisScenario } from '../support/redis.js';
import { type PrivateRedis, startPrivateRedis } from '../support/redis-server.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

const REDIS_URL = process.env.REDIS_URL ?? '';
/** A full resync starts at once (Redis 7 otherwise waits 5 s for more replicas to join a diskless transfer). */
const PROMPT_SYNC = ['--repl-diskless-sync-delay', '0'];

/** Grants and releases `count` times, one after the other; the fences in order. */
async function grants(manager: LockManager, name: string, count: number): Promise<bigint[]> {
  const fences: bigint[] = [];
  for (let i = 0; i < count; i++) {
    const lease = await manager.acquire(name, { ttlMs: 5_000, waitMs: 5_000 });
    fences.push(lease.fence);
    await lease.release();
  }
  return fences;
}

function max(fences: readonly bigint[]): bigint {
  let highest = 0n;
  for (const fence of fences) if (fence > highest) highest = fence;
  return highest;
}

/** A field of `INFO replication`. */
async function replication(redis: Redis, field: string): Promise<string | undefined> {
  const info = await redis.info('replication');
  return new RegExp(`^${field}:(.*)$`, 'm').exec(info)?.[1]?.trim();
}

/** Waits (bounded) until `replica` is in sync with its primary and holds `key`'s field as the primary has it. */
async function inSync(replica: Redis, primary: Redis, key: string): Promise<void> {
  for (let i = 0; i < 500; i++) {
    const [link, mine, theirs] = await Promise.all([
      replication(replica, 'master_link_status'),
      replica.hget(key, 'counter').catch(() => null),
      primary.hget(key, 'counter'),
    ]);
    if (link === 'up' && mine === theirs) return;
    await sleep(20);
  }
  throw new Error('the replica did not catch up within 500 polls');
}

interface Pair {
  readonly servers: readonly [PrivateRedis, PrivateRedis];
  readonly clients: readonly [Redis, Redis];
  readonly managers: readonly [LockManager, LockManager];
  readonly fenceKey: string;
}

/**
 * A primary P and its replica R (each its own redis-server and `--dir`; `replicaArgs` for R), and a
 * manager on each, one namespace.
 */
async function primaryAndReplica(s: RedisScenario, replicaArgs: readonly string[] = []): Promise<Pair> {
  const p = await startPrivateRedis(PROMPT_SYNC);
  const r = await startPrivateRedis([...PROMPT_SYNC, '--replicaof', '127.0.0.1', String(p.port), ...replicaArgs]);
  const clients = [connect(p.url), connect(r.url)] as const;
  const managers = [s.open({ client: clients[0] }), s.open({ client: clients[1] })] as const;
  onTestFinished(async () => {
    for (const m of managers) await m.close();
    for (const c of clients) c.disconnect();
    await Promise.all([p.stop(), r.stop()]);
  });
  return { servers: [p, r], clients, managers, fenceKey: redisKeyNames(s.namespace).fence };
}

describe.runIf(needs('REDIS_URL') && needs('DATABASE_URL') && needs('REDIS_SERVER'))(
  'redis lock manager when the replication history changes',
  () => {
    it('failback: the old primary, resynced from the promoted replica and promoted again, never re-issues a fence', async () => {
      const s = await redisScenario(REDIS_URL);
      const { servers, clients, managers, fenceKey } = await primaryAndReplica(s);
      const [onP, onR] = clients;
      const [viaP] = managers;

      const replicated = await grants(viaP, 'job', 3);
      await inSync(onR, onP, fenceKey);

      // Failover: R is promoted while P, not yet demoted, goes on granting (the usual window).
      await onR.replicaof('NO', 'ONE');
      const splitBrain = await grants(viaP, 'job', 5);
      expect(await onR.hget(fenceKey, 'counter')).toBe('3'); // R never saw them

      // P is made a replica of R: a full resync, after which P holds R's older counter.
      await onP.replicaof('127.0.0.1', String(servers[1].port));
      await inSync(onP, onR, fenceKey);
      expect(await onP.hget(fenceKey, 'counter')).toBe('3');

      // Failback: P is promoted again (same process, same run_id).
      await onP.replicaof('NO', 'ONE');
      const after = await grants(viaP, 'job', 5);

      const before = [...replicated, ...splitBrain];
      for (const fence of after) expect(fence).toBeGreaterThan(max(before));
      expect(new Set([...before, ...after]).size).toBe(before.length + after.length);
    });

    it('failover, grants on both sides of a split brain, failback: each history change starts above all before', async () => {
      const s = await redisScenario(REDIS_URL);
      const { servers, clients, managers, fenceKey } = await primaryAndReplica(s);
      const [onP, onR] = clients;
      const [viaP, viaR] = managers;
      const [p, r] = servers.map((server) => String(server.port)) as [string, string];

      const first = await grants(viaP, 'job', 3);
      await inSync(onR, onP, fenceKey);
      await onR.replicaof('NO', 'ONE'); // failover
      // The split brain: the old and the new primary both grant, interleaved.
      const onOld: bigint[] = [];
      const onNew: bigint[] = [];
      for (let i = 0; i < 4; i++) {
        onNew.push(...(await grants(viaR, 'job', 1)));
        onOld.push(...(await grants(viaP, 'job', 1)));
      }
      // The new primary's fences are above everything issued before the failover …
      for (const fence of onNew) expect(fence).toBeGreaterThan(max(first));
      // … and the old primary's split-brain fences are below the new primary's (its holders lose).
      expect(max(onOld)).toBeLessThan(onNew[0] as bigint);

      await onP.replicaof('127.0.0.1', r); // P demoted: a full resync from R
      await inSync(onP, onR, fenceKey);
      const beforeFailback = [...first, ...onOld, ...onNew, ...(await grants(viaR, 'job', 2))];
      await onP.replicaof('NO', 'ONE'); // failback: P is promoted …
      await onR.replicaof('127.0.0.1', p); // … and R follows it
      const afterFailback = await grants(viaP, 'job', 3);
      for (const fence of afterFailback) expect(fence).toBeGreaterThan(max(beforeFailback));

      // And back once more (R promoted again, after a resync from P).
      await inSync(onR, onP, fenceKey);
      const beforeSecond = [...beforeFailback, ...afterFailback, ...(await grants(viaP, 'job', 2))];
      await onP.replicaof('127.0.0.1', r);
      await onR.replicaof('NO', 'ONE');
      const afterSecond = await grants(viaR, 'job', 3);
      for (const fence of afterSecond) expect(fence).toBeGreaterThan(max(beforeSecond));

      const all = [...beforeSecond, ...afterSecond];
      expect(new Set(all).size).toBe(all.length);
      // Every history change took an epoch of its own.
      const epochs = new Set(all.map((f) => splitRedisFence(f as never).epoch));
      expect(epochs.size).toBeGreaterThanOrEqual(4);
    });

    it('an epoch install caught by a failback (placeholder replicated, resynced back, promoted): no fence of the epoch it took', async () => {
      const s = await redisScenario(REDIS_URL);
      const { servers, clients, fenceKey } = await primaryAndReplica(s);
      const [onP, onR] = clients;
      // A client on P puts its placeholder in Redis and takes an epoch, then pauses before activating it.
      const gate = pauseAfter(s.test.db, 'nextval');
      onTestFinished(gate.open);
      const paused = s.open({ client: connect(servers[0].url), epochs: gate.db, commandTimeoutMs: 20_000 });
      const pausedLease = paused.acquire('job', { ttlMs: 5_000, waitMs: 20_000 });
      const taken = await gate.reached;
      await inSync(onR, onP, fenceKey);
      expect(await onR.hget(fenceKey, 'state')).toBe('pending'); // the placeholder reached the replica

      // Failover and failback while it is paused: P is resynced from R (placeholder and all) and promoted again.
      await onR.replicaof('NO', 'ONE');
      await onP.replicaof('127.0.0.1', String(servers[1].port));
      await inSync(onP, onR, fenceKey);
      await onP.replicaof('NO', 'ONE');
      await onR.replicaof('127.0.0.1', String(servers[0].port));
      expect(await onP.hget(fenceKey, 'state')).toBe('pending'); // its own placeholder, nonce and all, on a new history
      gate.open();

      const lease = await pausedLease;
      // No fence of the epoch taken on the old history: the grant took a new one on the new history.
      expect(splitRedisFence(lease.fence).epoch).toBeGreaterThan(taken);
      await lease.release();
    });

    it('a restart that reloads an older RDB takes a new epoch: fences issued after the snapshot are not re-issued', async () => {
      const s = await redisScenario(REDIS_URL);
      const server = await startPrivateRedis();
      const client = connect(server.url);
      const manager = s.open({ client: client });
      onTestFinished(async () => {
        await manager.close();
        client.disconnect();
        await server.stop();
      });

      const snapshotted = await grants(manager, 'job', 3);
      await client.save(); // dump.rdb in the server's own --dir
      const lost = await grants(manager, 'job', 4); // issued, but not in the snapshot
      await server.restart(); // kill -9; the new process loads the older dump.rdb
      let counter: string | null = null;
      for (let i = 0; i < 100 && counter === null; i++) {
        counter = await client.hget(redisKeyNames(s.namespace).fence, 'counter').catch(() => null);
        if (counter === null) await sleep(20);
      }
      expect(counter).toBe('3'); // the snapshot's counter is back

      let after: bigint[] = [];
      for (let attempt = 0; attempt < 50 && after.length === 0; attempt++) {
        after = await grants(manager, 'job', 3).catch(() => []);
        if (after.length === 0) await sleep(50);
      }
      expect(after).toHaveLength(3);
      for (const fence of after) expect(fence).toBeGreaterThan(max([...snapshotted, ...lost]));
    });

    it('a restart that replays its AOF takes a new epoch, though the counter came back whole', async () => {
      const s = await redisScenario(REDIS_URL);
      const server = await startPrivateRedis(['--appendonly', 'yes', '--appendfsync', 'always']);
      const client = connect(server.url);
      const manager = s.open({ client });
      onTestFinished(async () => {
        await manager.close();
        client.disconnect();
        await server.stop();
      });
      const fenceKey = redisKeyNames(s.namespace).fence;

      const before = await grants(manager, 'job', 3);
      const counter = await client.hget(fenceKey, 'counter');
      const replid = await replication(client, 'master_replid');
      await server.restart(); // kill -9; the new process replays the AOF
      let back: string | null = null;
      for (let i = 0; i < 100 && back === null; i++) {
        back = await client.hget(fenceKey, 'counter').catch(() => null);
        if (back === null) await sleep(20);
      }
      expect(back).toBe(counter); // the same counter, every grant in it
      expect(await replication(client, 'master_replid')).not.toBe(replid);

      let after: bigint[] = [];
      for (let attempt = 0; attempt < 50 && after.length === 0; attempt++) {
        after = await grants(manager, 'job', 1).catch(() => []);
        if (after.length === 0) await sleep(50);
      }
      expect(after).toHaveLength(1);
      // A new epoch: the history is the process's new replication id, not the data the file brought back.
      expect(splitRedisFence(toFence(max(after))).epoch).toBeGreaterThan(splitRedisFence(toFence(max(before))).epoch);
    });

    it('a replica never grants, even a writable one: its locks and counter are not the primary’s', async () => {
      const s = await redisScenario(REDIS_URL);
      const { clients, managers } = await primaryAndReplica(s, ['--replica-read-only', 'no']);
      const [viaP, viaR] = managers;

      const fences = await grants(viaP, 'job', 2);
      const keys = redisKeyNames(s.namespace);
      await inSync(clients[1], clients[0], keys.fence);
      const outcome = await viaR.acquire('job', { ttlMs: 5_000 }).catch((e: unknown) => e);
      expect(outcome).toBeInstanceOf(FenceSourceError);
      expect(await clients[1].exists(keys.lock('job'))).toBe(0);
      expect(max(await grants(viaP, 'job', 1))).toBeGreaterThan(max(fences));

      // Nor does its copy of a lock held on P count as a grant for the holder's token (a re-sent grant).
      const held = await viaP.acquire('held', { ttlMs: 30_000 });
      for (let i = 0; i < 250 && !(await clients[1].exists(keys.lock('held'))); i++) await sleep(20);
      const token = (await lockToken(clients[0], keys.lock('held'))) ?? '';
      const run = scriptRunner(clients[1], [GRANT_SCRIPT], commandDeadline(2_000));
      expect(await runGrant(run, keys, 'held', token, 30_000, null, false, true)).toEqual({
        kind: 'no-epoch',
        reason: 'replica',
        observed: '',
      });
      await held.release();
    });

    it('a writable replica whose INFO shows role:master on another line (its primary host’s name) still grants nothing', async () => {
      const s = await redisScenario(REDIS_URL);
      const { clients, managers } = await primaryAndReplica(s, ['--replica-read-only', 'no']);
      const [viaP, viaR] = managers;

      const fences = await grants(viaP, 'job', 3);
      await inSync(clients[1], clients[0], redisKeyNames(s.namespace).fence);
      // R follows a "host" named role:master: cut off from P, it keeps P's replication id and a lagging counter.
      await clients[1].call('REPLICAOF', 'role:master', '6379');
      expect(await replication(clients[1], 'master_host')).toBe('role:master');
      fences.push(...(await grants(viaP, 'job', 3)));
      expect(await replication(clients[1], 'master_replid')).toBe(await replication(clients[0], 'master_replid'));

      const outcome = await viaR.tryAcquire('job', { ttlMs: 5_000 }).catch((e: unknown) => e);
      expect(outcome).toBeInstanceOf(FenceSourceError);
      expect(await clients[1].exists(redisKeyNames(s.namespace).lock('job'))).toBe(0);
    });

    it('a replica announcing an address that reads like a master_replid line does not change its primary’s history', async () => {
      const s = await redisScenario(REDIS_URL);
      const p = await startPrivateRedis(PROMPT_SYNC);
      // A first replica: attaching it makes P draw a new replication id (its backlog starts); later ones do not.
      const first = await startPrivateRedis([...PROMPT_SYNC, '--replicaof', '127.0.0.1', String(p.port)]);
      const client = connect(p.url);
      const manager = s.open({ client });
      onTestFinished(async () => {
        await manager.close();
        client.disconnect();
        await Promise.all([p.stop(), first.stop()]);
      });
      for (let i = 0; i < 250 && !(await client.info('replication')).includes('slave0:'); i++) await sleep(20);
      const before = await grants(manager, 'job', 1);
      const r = await startPrivateRedis([
        '--replicaof',
        '127.0.0.1',
        String(p.port),
        '--replica-announce-ip',
        'master_replid:0123456789abcdef',
      ]);
      onTestFinished(() => r.stop());
      for (let i = 0; i < 250 && !(await client.info('replication')).includes('ip=master_replid:'); i++)
        await sleep(20);
      const info = await client.info('replication');
      expect(info).toContain('slave1:ip=master_replid:0123456789abcdef');
      // What makes the last master_replid line Redis's own: only Redis's numbers follow it.
      const rest = info
        .slice(info.lastIndexOf('\r\nmaster_replid:') + 2)
        .trim()
        .split('\r\n')
        .slice(1);
      expect(rest.length).toBeGreaterThan(0);
      for (const line of rest) expect(line).toMatch(/^(master_replid2|\w+_offset|repl_backlog_\w+):[\w.-]*$/);

      const later = await grants(manager, 'job', 1);
      expect(splitRedisFence(toFence(max(later))).epoch).toBe(splitRedisFence(toFence(max(before))).epoch); // the same history
      expect(max(later)).toBeGreaterThan(max(before));
      expect(await client.hget(redisKeyNames(s.namespace).fence, 'id')).toBe(
        await replication(client, 'master_replid'),
      );
    });
  },
);
