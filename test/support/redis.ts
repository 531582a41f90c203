/**
 * What the Redis lock-manager suites share: a scenario (a database, a
 * namespace, a client and managers of the test's own, all cleaned up when
 * the test ends) and the worker configuration for child processes.
 */
import { PgDialect } from 'drizzle-orm/pg-core';
import { Redis } from 'ioredis';
import { onTestFinished } from 'vitest';
import type { Database } from '../../src/driver.js';
import type { LockBackend } from '../../src/fencing/backend.js';
import {
  type RedisLockManagerOptions,
  redisKeyNames,
  redisLockBackend,
} from '../../src/fencing/backends/redis/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import type { TestDatabase } from './databases.js';
import { scenarioDatabase, uniqueNamespace } from './scenario.js';

export interface RedisScenario {
  readonly test: TestDatabase;
  /** This test's own database URL (for workers). */
  readonly databaseUrl: string;
  readonly redisUrl: string;
  readonly namespace: string;
  readonly keys: ReturnType<typeof redisKeyNames>;
  /** A client of the test's own (commandTimeout 2 s, one retry). */
  readonly redis: Redis;
  /** A manager with epochs from the test's database. */
  readonly manager: LockManager;
  /** Another manager on this namespace (its own Redis client), with options overridden. */
  open(options?: Partial<Omit<RedisLockManagerOptions, 'namespace'>>): LockManager;
  /** The bare backend on this namespace (its own Redis client), for tests that drive grants token by token. */
  backend(): LockBackend;
  /** Arguments of test/workers/lock-worker.ts for this scenario. */
  worker(lock: string, extra?: Record<string, unknown>): Record<string, unknown>;
}

export function connect(url: string, db?: number): Redis {
  const redis = new Redis(url, { commandTimeout: 2_000, maxRetriesPerRequest: 1, ...(db === undefined ? {} : { db }) });
  redis.on('error', () => {}); // reconnects by itself; commands fail (bounded) meanwhile
  return redis;
}

/** A scenario for one test; everything is closed, and the namespace's keys deleted, when the test finishes. */
export async function redisScenario(redisUrl: string): Promise<RedisScenario> {
  const test = await scenarioDatabase();
  const namespace = uniqueNamespace();
  const keys = redisKeyNames(namespace);
  const redis = connect(redisUrl);
  const clients: Redis[] = [redis];
  // Managers and bare backends: each is closed when the test finishes.
  const managers: { close(): Promise<void> }[] = [];
  const open = (options: Partial<Omit<RedisLockManagerOptions, 'namespace'>> = {}) => {
    const client = options.client ?? connect(redisUrl);
    if (!options.client) clients.push(client as Redis);
    const manager = redisLockManager({ client, namespace, epochs: test.db, ...options });
    managers.push(manager);
    return manager;
  };
  const manager = open({ client: redis });
  onTestFinished(async () => {
    for (const m of managers) await m.close();
    if (redis.status === 'ready') await deleteNamespace(redis, namespace).catch(() => {});
    for (const client of clients) client.disconnect();
    await test.close();
  });
  return {
    test,
    databaseUrl: test.url ?? '',
    redisUrl,
    namespace,
    keys,
    redis,
    manager,
    open,
    backend() {
      const client = connect(redisUrl);
      clients.push(client);
      const backend = redisLockBackend({ client, namespace, epochs: test.db });
      managers.push(backend);
      return backend;
    },
    worker: (lock, extra = {}) => ({
      kind: 'redis',
      namespace,
      databaseUrl: test.url,
      redisUrl,
      lock,
      ttlMs: 5_000,
      waitMs: 10_000,
      ...extra,
    }),
  };
}

/** Every key of a namespace (SCAN, bounded). */
export async function namespaceKeys(redis: Redis, namespace: string): Promise<string[]> {
  const found: string[] = [];
  let cursor = '0';
  for (let i = 0; i < 10_000; i++) {
    const [next, batch] = await redis.scan(cursor, 'MATCH', `{palisade:${namespace}}*`, 'COUNT', 1000);
    found.push(...batch);
    cursor = next;
    if (cursor === '0') break;
  }
  return found.sort();
}

/** The token that holds a lock key (its value up to the first NUL: the grant record follows), or null if it is free. */
export async function lockToken(redis: Redis, key: string): Promise<string | null> {
  const value = await redis.get(key);
  return value === null ? null : (value.split('\0')[0] as string);
}

async function deleteNamespace(redis: Redis, namespace: string): Promise<void> {
  const keys = await namespaceKeys(redis, namespace);
  if (keys.length > 0) await redis.del(...keys);
}

/** The Redis Cluster hash tag of a key: what is between the first `{` and the next `}`, if non-empty. */
export function hashTag(key: string): string {
  const open = key.indexOf('{');
  if (open === -1) return key;
  const close = key.indexOf('}', open + 1);
  if (close === -1 || close === open + 1) return key;
  return key.slice(open + 1, close);
}

/**
 * The epochs database of a client that pauses (as a GC pause or SIGSTOP
 * would) right after the first statement containing `marker` (`nextval`:
 * after it put its placeholder in Redis and took an epoch) until `open()`. `reached` gives
 * the first value of the first row that statement returned.
 */
export function pauseAfter(
  db: Database,
  marker: string,
): {
  db: Database;
  reached: Promise<bigint>;
  open: () => void;
} {
  const dialect = new PgDialect();
  let reached!: (value: bigint) => void;
  let open!: () => void;
  const atGate = new Promise<bigint>((resolve) => {
    reached = resolve;
  });
  const gate = new Promise<void>((resolve) => {
    open = resolve;
  });
  let paused = false;
  const gated = new Proxy(db, {
    get(target, property, receiver) {
      if (property !== 'execute') return Reflect.get(target, property, receiver);
      return async (query: Parameters<Database['execute']>[0]) => {
        const result = await target.execute(query);
        if (!paused && dialect.sqlToQuery(query as never).sql.includes(marker)) {
          paused = true;
          const rows = (Array.isArray(result) ? result : (result as { rows: unknown[] }).rows) as Record<
            string,
            unknown
          >[];
          reached(BigInt(String(Object.values(rows[0] ?? {})[0])));
          await gate;
        }
        return result;
      };
    },
  });
  return { db: gated, reached: atGate, open };
}
