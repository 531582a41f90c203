/**
 * Redis forgets: FLUSHDB, and a restart without persistence, of a Redis
 * server this file starts for itself (so it touches nobody else's keys),
 * between grants and while other processes are granting. Every fence
 * issued after a reset must be above every fence issued before it.
 */
import { connect as connectTcp, createServer, type Server, type Socket } from 'node:net';
import { sql } from 'drizzle-orm';
import { Redis } from 'ioredis';
import { afterAll, afterEach, beforeAll, describe, expect, it, onTestFinished } from 'vitest';
import { execute } from '../../src/driver.js';
import { CommandTimeoutError, FenceSourceError, InvalidArgumentError } from '../../src/errors.js';
import { redisKeyNames, splitRedisFence } from '../../src/fencing/backends/redis/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { freePort } from '../support/ports.js';
import { killAllWorkers, type Message, startWorker, type Worker } from '../support/processes.js';
import { connect, redisScenario } from '../support/redis.js';
import { type PrivateRedis, startPrivateRedis } from '../support/redis-server.js';
import { needs } from '../support/services.js';

const WORKER = 'test/workers/lock-worker.ts';

/** One grant, retried (bounded) while the server comes back. */
async function grant(manager: LockManager, name: string): Promise<bigint> {
  let last: unknown;
  for (let attempt = 0; attempt < 50; attempt++) {
    try {
      const lease = await manager.acquire(name, { ttlMs: 5_000, waitMs: 5_000 });
      await lease.release();
      return lease.fence;
    } catch (err) {
      last = err;
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  throw last;
}

async function grants(manager: LockManager, name: string, count: number): Promise<bigint[]> {
  const fences: bigint[] = [];
  for (let i = 0; i < count; i++) fences.push(await grant(manager, name));
  return fences;
}

/**
 * A loopback TCP proxy to `port` that, once armed, drops the reply to the
 * first command whose text contains `marker` (the server still ran it), cuts
 * the connection and refuses new ones for 220 ms.
 */
async function replyDroppingProxy(port: number) {
  let marker: string | undefined;
  let dropped = false;
  let server: Server | undefined;
  const sockets = new Set<Socket>();
  const listen = () =>
    new Promise<void>((resolve) => {
      server = createServer((client) => {
        const upstream = connectTcp(port, '127.0.0.1');
        sockets.add(client).add(upstream);
        let cutNext = false;
        client.on('data', (data) => {
          if (marker !== undefined && data.toString().includes(marker)) {
            marker = undefined;
            cutNext = true;
          }
          upstream.write(data);
        });
        upstream.on('data', (data) => {
          if (!cutNext) return void client.write(data);
          cutNext = false;
          dropped = true;
          client.destroy();
          upstream.destroy();
          server?.close();
          setTimeout(() => void listen(), 220);
        });
        const end = () => {
          client.destroy();
          upstream.destroy();
        };
        for (const s of [client, upstream]) s.on('error', end).on('close', end);
      });
      server.listen(proxyPort, '127.0.0.1', () => resolve());
    });
  const proxyPort = await freePort();
  await listen();
  return {
    url: `redis://127.0.0.1:${proxyPort}`,
    dropReplyTo(text: string) {
      marker = text;
      dropped = false;
    },
    dropped: () => dropped,
    close() {
      for (const s of sockets) s.destroy();
      server?.close();
    },
  };
}

/** FLUSHALL from a client of its own. */
async function flushall(url: string): Promise<void> {
  const redis = connect(url);
  try {
    await redis.flushall();
  } finally {
    redis.disconnect();
  }
}

/** FLUSHDB from a client of its own. */
async function flushdb(url: string): Promise<void> {
  const redis = connect(url);
  try {
    await redis.flushdb();
  } finally {
    redis.disconnect();
  }
}

function max(fences: bigint[]): bigint {
  let highest = 0n;
  for (const fence of fences) if (fence > highest) highest = fence; // (Math.max takes no bigint)
  return highest;
}
const fencesOf = (worker: Worker) =>
  worker.messages.filter((m) => m.event === 'grant').map((m) => BigInt(String(m.fence)));

/** Waits (bounded) until `worker` has reported `count` more grants than `from`. */
async function moreGrants(worker: Worker, from: number, count: number): Promise<void> {
  await worker.next((m: Message) => m.event === 'grant' && Number(m.i) >= from + count - 1, 30_000);
}

describe.runIf(needs('REDIS_URL') && needs('DATABASE_URL'))('redis lock manager when Redis loses its data', () => {
  let server: PrivateRedis;
  beforeAll(async () => {
    server = await startPrivateRedis();
  });
  afterAll(async () => {
    await server?.stop();
  });
  afterEach(killAllWorkers);

  it('FLUSHDB between grants: later fences are above earlier ones', async () => {
    const { manager } = await redisScenario(server.url);
    const before = await grants(manager, 'job', 5);
    await flushdb(server.url);
    const after = await grants(manager, 'job', 5);

    for (const fence of after) expect(fence).toBeGreaterThan(max(before));
    expect(splitRedisFence(after[0] as never).epoch).toBeGreaterThan(splitRedisFence(before[4] as never).epoch);
  });

  it('a restart without persistence between grants: later fences are above earlier ones', async () => {
    const { manager, open } = await redisScenario(server.url);
    const other = open();
    const before = [...(await grants(manager, 'job', 3)), ...(await grants(other, 'job', 3))];
    await server.restart();
    const after = [...(await grants(other, 'job', 3)), ...(await grants(manager, 'job', 3))];

    for (const fence of after) expect(fence).toBeGreaterThan(max(before));
    expect(new Set([...before, ...after]).size).toBe(12);
  });

  it('without an epochs database, a restart makes grants fail instead of starting fences again', async () => {
    const { namespace } = await redisScenario(server.url);
    const redis = connect(server.url);
    const fresh = redisLockManager({ client: redis, namespace, allowFreshCounter: true });
    const first = await grant(fresh, 'job'); // the namespace's first use, explicitly allowed
    await server.restart();

    const strict = redisLockManager({ client: redis, namespace });
    let outcome: unknown;
    for (let attempt = 0; attempt < 50; attempt++) {
      outcome = await strict.acquire('job', { ttlMs: 5_000 }).catch((e: unknown) => e);
      if (outcome instanceof FenceSourceError) break; // not a connection error from the restart
      await new Promise((r) => setTimeout(r, 50));
    }
    expect(outcome).toBeInstanceOf(FenceSourceError);
    // What allowFreshCounter risks: after the reset it starts again, and hands out a fence it issued before.
    expect(await grant(fresh, 'job')).toBe(first);
    await Promise.all([strict.close(), fresh.close()]);
    redis.disconnect();
  });

  it('FLUSHDB and a restart while two processes are granting: no fence after a reset is at or below one before', async () => {
    const s = await redisScenario(server.url);
    const workers = await Promise.all(
      ['a', 'b'].map(async (lock) => {
        const worker = startWorker(WORKER, s.worker(lock, { ttlMs: 5_000, waitMs: 3_000 }));
        await worker.next((m) => m.event === 'ready');
        return worker;
      }),
    );
    for (const worker of workers) worker.send({ cmd: 'grantLoop', count: 100_000, maxMs: 60_000 });
    const reported = () => workers.flatMap(fencesOf);
    const progress = (w: Worker) => fencesOf(w).length;

    const checkpoints: { before: bigint; after: bigint }[] = [];
    const reset = async (how: () => Promise<unknown>) => {
      await Promise.all(workers.map((w) => moreGrants(w, progress(w), 20)));
      const before = max(reported()); // every grant reported so far happened before the reset
      await how();
      checkpoints.push({ before, after: await grant(s.manager, 'checkpoint') });
    };
    await reset(() => flushdb(server.url));
    await reset(() => server.restart());
    await reset(() => flushdb(server.url));

    await Promise.all(workers.map((w) => moreGrants(w, progress(w), 20)));
    for (const worker of workers) worker.send({ cmd: 'stop' });
    const done = await Promise.all(workers.map((w) => w.next((m) => m.event === 'grantLoopDone')));
    for (const [i, d] of done.entries()) expect(d.granted).toBe(fencesOf(workers[i] as Worker).length);
    for (const { before, after } of checkpoints) expect(after).toBeGreaterThan(before);
    for (const worker of workers) {
      const fences = fencesOf(worker);
      for (let i = 1; i < fences.length; i++) expect(fences[i]).toBeGreaterThan(fences[i - 1] as bigint);
      // Each reset lost the counter under this worker, which carried on in a new epoch each time.
      expect(new Set(fences.map((f) => splitRedisFence(f as never).epoch)).size).toBeGreaterThanOrEqual(4);
    }
    const all = [...reported(), ...checkpoints.map((c) => c.after)];
    expect(new Set(all).size).toBe(all.length);
    const last = await grant(s.manager, 'checkpoint');
    expect(last).toBeGreaterThan(max(all));
  });

  it('FLUSHALL, then a restart, under 45 namespaces recovering at once: every acquire succeeds above every earlier fence', async () => {
    const NAMESPACES = 45;
    const s = await redisScenario(server.url);
    // Two clients (two "processes") per namespace, each with its own manager: 90 recoveries race per reset.
    const clients = [connect(server.url), connect(server.url)];
    const namespaces = Array.from({ length: NAMESPACES }, (_, i) => `${s.namespace}-${i}`);
    const managers = namespaces.flatMap((namespace) =>
      clients.map((redis) => redisLockManager({ client: redis, namespace, epochs: s.test.db })),
    );
    onTestFinished(async () => {
      for (const m of managers) await m.close();
      for (const c of clients) c.disconnect();
    });
    const epochsTaken = async () =>
      BigInt(String((await execute(s.test.db, sql`select last_value from palisade.epoch_seq`))[0]?.last_value));
    const everyone = () =>
      Promise.allSettled(
        managers.map(async (manager) => {
          const lease = await manager.acquire('job', { ttlMs: 5_000, waitMs: 10_000 });
          await lease.release();
          return lease.fence;
        }),
      );
    const fulfilled = (results: PromiseSettledResult<bigint>[]) => {
      const failures = results.flatMap((r) => (r.status === 'rejected' ? [String(r.reason)] : []));
      expect(failures, `${failures.length} of ${results.length} acquires failed`).toEqual([]);
      return results.map((r) => (r as PromiseFulfilledResult<bigint>).value);
    };

    let earlier = fulfilled(await everyone());
    for (const reset of [() => flushall(server.url), () => server.restart()]) {
      await reset();
      const taken = await epochsTaken();
      const later = fulfilled(await everyone()); // all at once, right after the reset
      // Every namespace found its counter gone; each got a new epoch above every fence issued before the reset.
      for (const fence of later) expect(fence).toBeGreaterThan(max(earlier));
      // Bounded: about one epoch per namespace (a client that lost the race to install one waits and joins it).
      expect(Number((await epochsTaken()) - taken)).toBeLessThanOrEqual(2 * NAMESPACES);
      earlier = [...earlier, ...later];
    }
    expect(new Set(earlier).size).toBe(earlier.length);
  });

  it('a failover to a replica that lagged behind: fences on the new primary are above all of the old one', async () => {
    const { namespace, test } = await redisScenario(server.url);
    const primary = await startPrivateRedis();
    const replica = await startPrivateRedis(['--replicaof', '127.0.0.1', String(primary.port)]);
    const clients = [connect(primary.url), connect(replica.url)] as const;
    const [onPrimary, onReplica] = clients;
    const managers = [onPrimary, onReplica].map((redis) =>
      redisLockManager({ client: redis, namespace, epochs: test.db }),
    );
    onTestFinished(async () => {
      for (const m of managers) await m.close();
      for (const c of clients) c.disconnect();
      await Promise.all([primary.stop(), replica.stop()]);
    });
    const [oldPrimary, newPrimary] = managers as [LockManager, LockManager];
    const fenceKey = redisKeyNames(namespace).fence;

    const replicated = await grants(oldPrimary, 'job', 3);
    const counter = await onPrimary.hget(fenceKey, 'counter');
    // The replica's first sync forks the primary for a snapshot: on a loaded 2-core machine that has
    // taken over 5 s (a full `npm test` run), so the wait is bounded at 15 s.
    for (let i = 0; i < 750 && (await onReplica.hget(fenceKey, 'counter')) !== counter; i++) {
      await new Promise((r) => setTimeout(r, 20));
    }
    expect(await onReplica.hget(fenceKey, 'counter')).toBe(counter);

    replica.pause(); // a partition: the replica stops, the primary drops it, and these grants never reach it
    await onPrimary.call('CLIENT', 'KILL', 'TYPE', 'replica');
    const lost = await grants(oldPrimary, 'job', 5);
    await primary.stop();
    replica.resume();
    await onReplica.replicaof('NO', 'ONE'); // the failover
    expect(await onReplica.hget(fenceKey, 'counter')).toBe(counter); // the promoted replica's counter is behind

    const after = await grants(newPrimary, 'job', 3);
    for (const fence of after) expect(fence).toBeGreaterThan(max([...replicated, ...lost]));
  });

  // Found by an outside review: the backend gave back the lock of a grant whose reply was lost (a
  // release sent in the background), and the acquire retried with the same token. After the
  // reconnect the release met NOSCRIPT and was sent again as EVAL, behind the retried grant, which
  // had got the lock: the release then freed the new lease's lock, and a second client got it
  // while the first lease was live.
  it('a grant whose reply is lost: the retry never has its lock freed by the give-back of the failed attempt', async () => {
    const proxy = await replyDroppingProxy(server.port);
    onTestFinished(() => proxy.close());
    const { manager: other, namespace, test } = await redisScenario(server.url);
    for (let trial = 0; trial < 3; trial++) {
      const admin = connect(server.url);
      await admin.script('FLUSH'); // the script cache as after a restart or a failover
      admin.disconnect();
      const warm = await other.tryAcquire(`warm-${trial}`, { ttlMs: 30_000 }); // the grant script is loaded again
      // ioredis' default offline queue: commands sent while the connection is down wait for it.
      const victimClient = new Redis(proxy.url, { maxRetriesPerRequest: 1, commandTimeout: 2_000 });
      victimClient.on('error', () => {});
      const victim = redisLockManager({ client: victimClient, namespace, epochs: test.db });
      proxy.dropReplyTo(`:lock:L${trial}\r\n`);
      const lease = await victim.acquire(`L${trial}`, { ttlMs: 10_000, waitMs: 5_000 });
      expect(proxy.dropped()).toBe(true); // the first attempt's reply was lost, then it retried
      // Whatever the failed attempt's give-back does, whenever it lands, it cannot touch this lease's lock.
      await new Promise((r) => setTimeout(r, 300));
      expect(lease.signal.aborted).toBe(false);
      expect((await other.inspect(`L${trial}`))?.fence).toBe(lease.fence);
      expect(await other.tryAcquire(`L${trial}`, { ttlMs: 10_000 })).toBeNull();
      expect(await lease.release()).toBe('released');
      await warm?.release();
      await victim.close();
      victimClient.disconnect();
    }
  });

  it('a release subscriber closed just as it reconnects leaves no unhandled rejection', async () => {
    const { namespace, test } = await redisScenario(server.url);
    const subscribers: Redis[] = [];
    // A real client whose duplicates (the release subscriber) the test can reach.
    class Watched extends Redis {
      override duplicate(...args: Parameters<Redis['duplicate']>): Redis {
        const copy = super.duplicate(...args);
        subscribers.push(copy);
        return copy;
      }
    }
    const unhandled: unknown[] = [];
    const onUnhandled = (reason: unknown) => unhandled.push(reason);
    process.on('unhandledRejection', onUnhandled);
    const redis = new Watched(server.url, { maxRetriesPerRequest: 1 });
    redis.on('error', () => {});
    const manager = redisLockManager({ client: redis, namespace, epochs: test.db });
    onTestFinished(async () => {
      process.off('unhandledRejection', onUnhandled);
      await manager.close();
      redis.disconnect();
    });
    const held = await manager.acquire('job', { ttlMs: 5_000 });
    // A waiter opens the release subscriber.
    const waiter = manager.acquire('job', { ttlMs: 5_000, waitMs: 1_000 }).catch((e: unknown) => e);
    const admin = connect(server.url);
    onTestFinished(() => admin.disconnect());
    for (let i = 0; i < 250 && !String(await admin.call('CLIENT', 'LIST', 'TYPE', 'pubsub')).trim(); i++) {
      await new Promise((r) => setTimeout(r, 10));
    }
    const subscriber = subscribers[0] as Redis;
    // Cut off, it reconnects; at 'ready' its re-subscription is on the wire, unanswered, when it is closed.
    const closed = new Promise((resolve) =>
      subscriber.once('ready', () => {
        subscriber.disconnect();
        // disconnect() ends the socket gracefully and the reply may still come in; dropping it
        // now makes the close land before the reply, as it can when a connection drops.
        (subscriber as unknown as { stream: { destroy(): void } }).stream.destroy();
        resolve(undefined);
      }),
    );
    await admin.call('CLIENT', 'KILL', 'TYPE', 'pubsub');
    await closed;
    await Promise.all([waiter, held.release()]);
    await new Promise((r) => setTimeout(r, 50)); // a rejection nobody handled is reported by now
    expect(unhandled.map(String)).toEqual([]);
  });

  it('a Redis that stops answering makes calls fail with CommandTimeoutError, never hang', async () => {
    const { namespace, test } = await redisScenario(server.url);
    // A client without a commandTimeout of its own: only palisade's bound applies.
    const redis = new Redis(server.url, { maxRetriesPerRequest: 1 });
    redis.on('error', () => {});
    const manager = redisLockManager({ client: redis, namespace, epochs: test.db, commandTimeoutMs: 300 });
    onTestFinished(async () => {
      server.resume();
      await manager.close();
      redis.disconnect();
    });
    await grant(manager, 'job'); // the namespace's fence state exists

    server.pause();
    await expect(manager.acquire('job', { ttlMs: 60_000 })).rejects.toBeInstanceOf(CommandTimeoutError);
    await expect(manager.inspect('job')).rejects.toBeInstanceOf(CommandTimeoutError);
    server.resume();

    // The grant that timed out ran once the server woke up; the release palisade queued behind it freed the lock
    // (long before its 60 s TTL).
    let info: unknown = 'not asked yet';
    for (let i = 0; i < 250 && info !== null; i++) {
      info = await manager.inspect('job').catch((e: unknown) => e);
      if (info !== null) await new Promise((r) => setTimeout(r, 20));
    }
    expect(info).toBeNull();
    const next = await manager.acquire('job', { ttlMs: 5_000 });
    await next.release();
  });

  it('bad input throws InvalidArgumentError without a single command reaching the server', async () => {
    const { manager, redis } = await redisScenario(server.url);
    await grant(manager, 'warm-up');
    const monitor = await connect(server.url).monitor();
    const seen: string[][] = [];
    monitor.on('monitor', (_time: string, args: string[]) => seen.push(args));
    const rejectsInvalid = (call: () => unknown) =>
      expect(Promise.resolve().then(call)).rejects.toBeInstanceOf(InvalidArgumentError);

    for (const name of ['', 'é'.repeat(513), '\uDC00', '\u0000']) {
      await rejectsInvalid(() => manager.acquire(name, { ttlMs: 1_000 }));
      await rejectsInvalid(() => manager.tryAcquire(name, { ttlMs: 1_000 }));
      await rejectsInvalid(() => manager.inspect(name));
    }
    for (const ttlMs of [0, -1, 1.5, Number.NaN, 86_400_001]) {
      await rejectsInvalid(() => manager.acquire('job', { ttlMs }));
      await rejectsInvalid(() => manager.using('job', { ttlMs }, () => 1));
    }
    await rejectsInvalid(() => manager.acquire('job', { ttlMs: 1_000, waitMs: -1 }));
    await rejectsInvalid(() => manager.acquireAll(['job', ''], { ttlMs: 1_000 }));

    await redis.echo('marker'); // the monitor is live: this shows up, and nothing before it
    for (let i = 0; i < 100 && seen.length === 0; i++) await new Promise((r) => setTimeout(r, 20));
    monitor.disconnect();
    expect(seen.map((args) => args.join(' '))).toEqual(['echo marker']);
  });
});
