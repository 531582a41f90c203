/**
 * A lock service that is down, not up yet, or dies under a held lease: what
 * the user sees is palisade's error (code `lock_service`, the client's error
 * as its cause), within the wait they asked for — never ioredis's bare Error.
 * Real Redis servers of the test's own, really stopped; a port where nothing
 * listens for "connection refused".
 */
import { performance } from 'node:perf_hooks';
import { Redis } from 'ioredis';
import { afterEach, describe, expect, it } from 'vitest';
import { LockServiceError, PalisadeError } from '../../src/errors.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { freePorts } from '../support/ports.js';
import { type PrivateRedis, startPrivateRedis } from '../support/redis-server.js';
import { needs } from '../support/services.js';

const clients: Redis[] = [];
const servers: PrivateRedis[] = [];
afterEach(async () => {
  for (const c of clients.splice(0)) c.disconnect();
  for (const s of servers.splice(0)) await s.stop();
});

/** The client as the README configures it. */
function readmeClient(url: string): Redis {
  const redis = new Redis(url, { commandTimeout: 2_000, maxRetriesPerRequest: 1, enableOfflineQueue: false });
  redis.on('error', () => {}); // ioredis reconnects by itself; without a listener it logs every failure
  clients.push(redis);
  return redis;
}

function manager(redis: Redis, extra: { commandTimeoutMs?: number } = {}): LockManager {
  // allowFreshCounter: these tests are about reaching Redis, not about the fence floor in Postgres.
  return redisLockManager({
    client: redis,
    namespace: `svc-${process.pid}-${Math.random()}`,
    allowFreshCounter: true,
    ...extra,
  });
}

describe('Redis down: connection refused', () => {
  it('acquire retries within waitMs, then throws LockServiceError saying connection refused', async () => {
    const [port] = await freePorts(1);
    const locks = manager(readmeClient(`redis://127.0.0.1:${port}`));
    const err = await locks.acquire('job', { ttlMs: 5_000, waitMs: 600 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(LockServiceError);
    expect(err).toMatchObject({ code: 'lock_service', service: 'redis' });
    expect((err as Error).message).toMatch(/connection refused/);
    expect((err as Error).message).toMatch(/waitMs = 600/);
    expect((err as Error).cause).toBeInstanceOf(Error);
    await locks.close();
  });

  it('with an offline queue, acquire still gives up at waitMs, not at the 5 s command timeout', async () => {
    const [port] = await freePorts(1);
    const redis = new Redis(`redis://127.0.0.1:${port}`, { maxRetriesPerRequest: null });
    redis.on('error', () => {});
    clients.push(redis);
    const locks = manager(redis, { commandTimeoutMs: 30_000 });
    const started = performance.now();
    const err = await locks.acquire('job', { ttlMs: 5_000, waitMs: 500 }).catch((e: unknown) => e);
    // Loose on purpose (a noisy machine): the regression was waiting for the command timeout, 30 s here.
    expect(performance.now() - started).toBeLessThan(20_000);
    expect(err).toBeInstanceOf(LockServiceError);
    expect((err as Error).message).toMatch(/redis lock service is unreachable/);
    // Disconnect first: a close() that unsubscribes through the offline queue waits for the command timeout.
    redis.disconnect();
    await locks.close();
  });

  it('tryAcquire and inspect fail with LockServiceError too', async () => {
    const [port] = await freePorts(1);
    const locks = manager(readmeClient(`redis://127.0.0.1:${port}`));
    await expect(locks.tryAcquire('job', { ttlMs: 5_000 })).rejects.toBeInstanceOf(LockServiceError);
    await expect(locks.inspect('job')).rejects.toBeInstanceOf(LockServiceError);
    await locks.close();
  });
});

describe('many managers on one client', () => {
  it('each says why Redis is down, through one pair of listeners on the client; close() removes them', async () => {
    const [port] = await freePorts(1);
    const redis = readmeClient(`redis://127.0.0.1:${port}`);
    // ioredis listens for 'ready' itself while one of its connection attempts is on its way (a handler named
    // connectionReadyHandler, gone when the attempt fails): not counted, or the count follows its retries.
    const counts = () => ({
      error: redis.listenerCount('error'),
      ready: redis.listeners('ready').filter((l) => l.name !== 'connectionReadyHandler').length,
    });
    const before = counts();
    const warnings: Error[] = [];
    const onWarning = (w: Error) => warnings.push(w);
    process.on('warning', onWarning);
    try {
      const managers = Array.from({ length: 20 }, () => manager(redis));
      expect(counts()).toEqual({ error: before.error + 1, ready: before.ready + 1 });
      // A wait long enough for the client's first connection attempt to fail even on a loaded machine (at
      // 300 ms one run ended before it, and the managers could only say that the client was not connected).
      const errors = await Promise.all(
        managers.map((m) => m.acquire('job', { ttlMs: 5_000, waitMs: 2_000 }).catch((e: unknown) => e)),
      );
      for (const err of errors) expect((err as Error).message).toMatch(/connection refused/);
      // A manager closed twice does not close the others' watch.
      await managers[0]?.close();
      await managers[0]?.close();
      expect(counts()).toEqual({ error: before.error + 1, ready: before.ready + 1 });
      const err = await managers[1]?.acquire('job', { ttlMs: 5_000, waitMs: 300 }).catch((e: unknown) => e);
      expect((err as Error).message).toMatch(/connection refused/);
      for (const m of managers.slice(1)) await m.close();
      expect(counts()).toEqual(before);
      // Warnings are emitted on the next tick.
      await new Promise((resolve) => setImmediate(resolve));
      expect(warnings.filter((w) => w.name === 'MaxListenersExceededWarning')).toEqual([]);
    } finally {
      process.off('warning', onWarning);
    }
  });
});

describe.runIf(needs('REDIS_SERVER'))('Redis coming up and going away (a server of our own)', () => {
  // Regression: "Stream isn't writeable and enableOfflineQueue options is false" from the first acquire.
  it('the first acquire right after new Redis(…) with the README options succeeds', async () => {
    const server = await startPrivateRedis();
    servers.push(server);
    const locks = manager(readmeClient(server.url));
    const lease = await locks.acquire('job', { ttlMs: 5_000, waitMs: 10_000 });
    expect(lease.fence).toBeGreaterThan(0n);
    expect(await lease.release()).toBe('released');
    await locks.close();
  });

  // Regression: release() threw ioredis's error when Redis had died under the lease.
  it('Redis killed while a lease is held: release() returns lost, extend() throws LeaseLostError', async () => {
    const server = await startPrivateRedis();
    servers.push(server);
    const locks = manager(readmeClient(server.url));
    const lease = await locks.acquire('job', { ttlMs: 10_000, waitMs: 10_000 });
    const other = await locks.acquire('other', { ttlMs: 10_000, waitMs: 10_000 });
    await server.stop();
    servers.splice(servers.indexOf(server), 1);
    const extended = await other.extend().catch((e: unknown) => e);
    expect(extended).toBeInstanceOf(PalisadeError);
    expect(extended).toMatchObject({ code: 'lease_lost' });
    expect(await lease.release()).toBe('lost');
    expect(await lease.release()).toBe('lost'); // still safe to call twice
    expect(await other.release()).toBe('lost');
    await locks.close();
  });
});

describe('etcd unreachable', () => {
  // Regression: etcd failures were plain Errors (no code).
  it('acquire, tryAcquire and inspect throw LockServiceError (code lock_service), cause kept', async () => {
    const [port] = await freePorts(1);
    const { Etcd3 } = await import('etcd3');
    const { etcdLockManager } = await import('../../src/fencing/backends/etcd/manager.js');
    const client = new Etcd3({ hosts: [`http://127.0.0.1:${port}`] });
    const locks = etcdLockManager({ client, namespace: 'svc', commandTimeoutMs: 1_000 });
    try {
      for (const call of [
        () => locks.acquire('job', { ttlMs: 5_000, waitMs: 500 }),
        () => locks.tryAcquire('job', { ttlMs: 5_000 }),
        () => locks.inspect('job'),
      ]) {
        const err = await call().catch((e: unknown) => e);
        expect(err).toBeInstanceOf(LockServiceError);
        expect(err).toMatchObject({ code: 'lock_service', service: 'etcd' });
        expect((err as Error).cause).toBeDefined();
      }
    } finally {
      await locks.close();
      client.close();
    }
  });
});
