/**
 * Every lock the benchmark compares, behind one small interface: palisade's
 * managers (Redis, Postgres lease, Postgres advisory) and the peers a user
 * would otherwise pick (redis-semaphore's Mutex, redlock, and — when a build
 * is given in SYNCGUARD_PATH — syncguard).
 *
 * Fair settings: every lock gets the same TTL; polling peers retry every
 * 10 ms (redis-semaphore's default; redlock's default of 200 ms would only
 * make it look worse); every lock's client is a fresh ioredis connection on
 * the same server.
 */
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { Redlock } from '@sesamecare-oss/redlock';
import { drizzle } from 'drizzle-orm/postgres-js';
import type { Redis } from 'ioredis';
import { Mutex } from 'redis-semaphore';
import type { Database } from '../../src/driver.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { sleep } from '../../test/support/sleep.js';
import type { BenchContext } from './context.js';
import { queriesSent } from './services.js';

/** TTL every lock gets (ms): long enough never to expire during a benchmark. */
export const TTL_MS = 10_000;
/** Polling interval of the peers that poll (ms). */
export const PEER_RETRY_MS = 10;

export interface Held {
  /** The fence the lock issued, or `null` for locks that issue none. */
  readonly fence: bigint | null;
  release(): Promise<unknown>;
}

export interface LockUnderTest {
  readonly label: string;
  readonly store: 'redis' | 'postgres';
  readonly issuesFences: boolean;
  /** Waits at most `waitMs`; throws when the wait ends without the lock. */
  acquire(name: string, waitMs: number, opts?: { autoExtend?: boolean }): Promise<Held>;
  /** palisade's manager, for the sections that need more than acquire/release. */
  readonly manager?: LockManager;
  /** Redis commands (pub/sub connections excluded) or Postgres queries this lock's clients have sent so far. */
  sent(): number;
  close(): Promise<void>;
}

function palisade(
  label: string,
  store: 'redis' | 'postgres',
  manager: LockManager,
  close: () => Promise<void>,
  sent: () => number = () => 0,
): LockUnderTest {
  return {
    label,
    store,
    issuesFences: true,
    manager,
    sent,
    async acquire(name, waitMs, opts) {
      const lease = await manager.acquire(name, { ttlMs: TTL_MS, waitMs, autoExtend: opts?.autoExtend === true });
      return { fence: lease.fence, release: () => lease.release() };
    },
    async close() {
      await manager.close();
      await close();
    },
  };
}

/** palisade's Redis manager on its own connection; fence epochs from the run's Postgres. */
export function palisadeRedis(ctx: BenchContext, namespace = 'bench'): LockUnderTest {
  const redis = newRedis(ctx);
  const manager = redisLockManager({
    client: redis,
    namespace: `${ctx.redis.prefix}${namespace}`.replaceAll(':', '.'),
    epochs: ctx.pg.db,
  });
  return palisade(
    'palisade Redis',
    'redis',
    manager,
    async () => redis.disconnect(),
    () => sentBy(redis),
  );
}

/** palisade's Postgres lease manager on a postgres.js client of its own (`max` connections). */
export function palisadePostgres(ctx: BenchContext, namespace = 'bench', max = 20): LockUnderTest {
  const sql = ctx.pg.client(max, undefined, { countQueries: true });
  const db = drizzle(sql) as unknown as Database;
  const manager = postgresLockManager({ client: db, namespace });
  return palisade(
    'palisade Postgres lease',
    'postgres',
    manager,
    async () => {
      await sql.end({ timeout: 5 });
    },
    () => queriesSent(sql),
  );
}

/** palisade's advisory-lock manager. */
export async function palisadeAdvisory(
  ctx: BenchContext,
  namespace = 'bench',
  max = 20,
): Promise<LockUnderTest | undefined> {
  const sql = ctx.pg.client(max, undefined, { countQueries: true });
  // Up to 16 idle sessions kept for reuse (the default, 1, would open a connection per grant at 16 clients).
  const manager = advisoryLockManager({ client: sql, namespace, maxIdleSessions: 16 });
  return palisade(
    'palisade Postgres advisory',
    'postgres',
    manager,
    async () => {
      await sql.end({ timeout: 5 });
    },
    () => queriesSent(sql),
  );
}

/** redis-semaphore's Mutex: `SET NX PX` per attempt, polling every 10 ms; release is one script. No fences. */
export function redisSemaphore(ctx: BenchContext): LockUnderTest {
  const redis = newRedis(ctx);
  return {
    label: 'redis-semaphore Mutex',
    store: 'redis',
    issuesFences: false,
    sent: () => sentBy(redis),
    async acquire(name, waitMs) {
      const mutex = new Mutex(redis, `${ctx.redis.prefix}rs:${name}`, {
        lockTimeout: TTL_MS,
        acquireTimeout: waitMs,
        retryInterval: PEER_RETRY_MS,
        refreshInterval: 0, // palisade's watchdog is off by default too
      });
      await mutex.acquire();
      return { fence: null, release: () => mutex.release() };
    },
    async close() {
      redis.disconnect();
    },
  };
}

/** redlock (the maintained fork) on one Redis: a script per attempt, retry every 10 ms ± 10 ms jitter. No fences. */
export function redlock(ctx: BenchContext): LockUnderTest {
  const redis = newRedis(ctx);
  const instance = new Redlock([redis], { retryCount: 0, retryDelay: PEER_RETRY_MS, retryJitter: PEER_RETRY_MS });
  // redlock emits `error` for every failed attempt (a busy lock included): without a listener the process dies.
  instance.on('error', () => {});
  return {
    label: 'redlock (@sesamecare-oss)',
    store: 'redis',
    issuesFences: false,
    sent: () => sentBy(redis),
    async acquire(name, waitMs) {
      const retryCount = Math.max(0, Math.ceil(waitMs / PEER_RETRY_MS));
      const lock = await instance.acquire([`${ctx.redis.prefix}rl:${name}`], TTL_MS, { retryCount });
      return { fence: null, release: () => lock.release() };
    },
    async close() {
      redis.disconnect();
    },
  };
}

interface SyncguardBackend {
  acquire(args: { key: string; ttlMs: number }): Promise<{ ok: boolean; lockId?: string; fence?: string }>;
  release(args: { lockId: string }): Promise<{ ok: boolean }>;
}

/**
 * syncguard's Redis backend from a local build (SYNCGUARD_PATH), or
 * `undefined`. Its backends make one attempt; its `lock(fn)` helper retries
 * but does not hand the fence to `fn`, so the waiting here mirrors that
 * helper (exponential backoff with "equal" jitter) with a 10 ms base like
 * the other polling peers.
 */
export async function syncguard(ctx: BenchContext): Promise<LockUnderTest | undefined> {
  if (!ctx.syncguardPath) return undefined;
  const entry = join(ctx.syncguardPath, 'redis', 'index.js');
  if (!existsSync(entry)) throw new Error(`SYNCGUARD_PATH has no redis/index.js: ${entry}`);
  const mod = (await import(pathToFileURL(entry).href)) as {
    createRedisBackend(redis: Redis, options: { keyPrefix: string }): SyncguardBackend;
  };
  const redis = newRedis(ctx);
  const backend = mod.createRedisBackend(redis, { keyPrefix: `${ctx.redis.prefix}sg` });
  return {
    label: 'syncguard (Redis)',
    store: 'redis',
    issuesFences: true,
    sent: () => sentBy(redis),
    async acquire(name, waitMs) {
      const deadline = Date.now() + waitMs;
      for (let attempt = 1; ; attempt++) {
        const r = await backend.acquire({ key: name, ttlMs: TTL_MS });
        if (r.ok && r.lockId) {
          const lockId = r.lockId;
          return { fence: BigInt(r.fence ?? '0'), release: () => backend.release({ lockId }) };
        }
        const left = deadline - Date.now();
        if (left <= 0) throw new Error(`syncguard: timed out waiting for ${name}`);
        const base = PEER_RETRY_MS * 2 ** Math.min(attempt - 1, 10);
        await sleep(Math.min(left, base / 2 + (Math.random() * base) / 2));
      }
    },
    async close() {
      redis.disconnect();
    },
  };
}

const sentCounts = new WeakMap<Redis, { n: number }>();

/** A new ioredis connection whose sent commands are counted (client side: exact, and cheap enough to leave on). */
function newRedis(ctx: BenchContext): Redis {
  const redis = ctx.redis.client();
  const counter = { n: 0 };
  sentCounts.set(redis, counter);
  const send = redis.sendCommand.bind(redis);
  redis.sendCommand = ((...args: Parameters<Redis['sendCommand']>) => {
    counter.n++;
    return send(...args);
  }) as Redis['sendCommand'];
  return redis;
}

function sentBy(redis: Redis): number {
  return sentCounts.get(redis)?.n ?? 0;
}

/** All Redis locks of the comparison: palisade first, then the peers that could be loaded. */
export async function redisLocks(ctx: BenchContext): Promise<LockUnderTest[]> {
  const locks = [palisadeRedis(ctx), redisSemaphore(ctx), redlock(ctx)];
  const sg = await syncguard(ctx);
  if (sg) locks.push(sg);
  return locks;
}
