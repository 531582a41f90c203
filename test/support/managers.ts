/**
 * Opens a lock manager of any backend from plain configuration, the same
 * way in a test and in a worker process. Each backend's case lives here so
 * that suites and workers are written once for all backends.
 */
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import type { Database } from '../../src/driver.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';

export type BackendKind = 'redis' | 'postgres' | 'advisory' | 'etcd';

export interface ManagerConfig {
  readonly kind: BackendKind;
  readonly namespace: string;
  /** A database of the test's own on the real Postgres (palisade migrated). */
  readonly databaseUrl: string;
  readonly redisUrl?: string;
  /** Client URLs of every member of an etcd cluster (`http://127.0.0.1:port`), for the etcd backend. */
  readonly etcdEndpoints?: readonly string[];
}

export interface OpenManager {
  readonly manager: LockManager;
  /** A drizzle database on `databaseUrl`, for fenced repositories. */
  readonly db: Database;
  close(): Promise<void>;
}

export async function openManager(config: ManagerConfig): Promise<OpenManager> {
  const client = postgres(config.databaseUrl, { max: 4, onnotice: () => {} });
  const db = drizzle(client) as unknown as Database;
  const closers: (() => Promise<unknown>)[] = [];
  let manager: LockManager;
  switch (config.kind) {
    case 'redis': {
      if (!config.redisUrl) throw new Error('the redis backend needs redisUrl');
      const redis = new Redis(config.redisUrl, { commandTimeout: 2_000, maxRetriesPerRequest: 1 });
      redis.on('error', () => {}); // reconnects by itself; commands fail (bounded) meanwhile
      closers.push(async () => redis.disconnect());
      manager = redisLockManager({ client: redis, namespace: config.namespace, epochs: db, commandTimeoutMs: 3_000 });
      break;
    }
    case 'etcd': {
      if (!config.etcdEndpoints?.length) throw new Error('the etcd backend needs etcdEndpoints');
      // Loaded only here: etcd3 (and gRPC) is an optional peer dependency.
      const { Etcd3 } = await import('etcd3');
      const { etcdLockManager } = await import('../../src/fencing/backends/etcd/manager.js');
      const etcd = new Etcd3({ hosts: [...config.etcdEndpoints] });
      closers.push(async () => etcd.close());
      manager = etcdLockManager({ client: etcd, namespace: config.namespace });
      break;
    }
    case 'postgres':
      manager = postgresLockManager({ client: db, namespace: config.namespace });
      break;
    case 'advisory':
      manager = advisoryLockManager({ client: client, namespace: config.namespace });
      break;
    default:
      throw new Error(`backend ${config.kind} is not wired into test/support/managers.ts yet`);
  }
  return {
    manager,
    db,
    async close() {
      await manager.close();
      for (const close of closers) await close();
      await client.end({ timeout: 5 });
    },
  };
}
