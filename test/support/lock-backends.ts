/**
 * Opens a built-in lock backend from plain configuration, the same way in a
 * test and in a worker process, and describes it to the backend contract
 * suite (`describeLockBackend`). This file is the contract's process module:
 * its `openBackend` runs in the suite's worker processes.
 */
import { fileURLToPath } from 'node:url';
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import { execute } from '../../src/driver.js';
import { forwardTo, type LockBackend } from '../../src/fencing/backend.js';
import { advisoryLockBackend } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { advisoryKey, advisoryKeyParts } from '../../src/fencing/backends/postgres-advisory/keys.js';
import { postgresLockBackend } from '../../src/fencing/backends/postgres-lease/backend.js';
import { redisLockBackend } from '../../src/fencing/backends/redis/backend.js';
import type { LockManagerHooks } from '../../src/fencing/lock-manager.js';
import { SERVER_WAIT_GRACE_MS } from '../../src/fencing/options.js';
import type { ContractSubject, LockBackendContract } from '../../src/testing/contract.js';
import type { BackendKind } from './managers.js';
import { uniqueNamespace } from './scenario.js';

/** Where a backend keeps its locks: serialisable, so a worker process opens the same one. */
export interface BackendConfig {
  readonly kind: BackendKind;
  readonly namespace: string;
  /** A database of the test file's own on the real Postgres, palisade migrated (also Redis' epochs). */
  readonly databaseUrl: string;
  readonly redisUrl?: string;
  /** Client URLs of every member of an etcd cluster. */
  readonly etcdEndpoints?: readonly string[];
}

export interface OpenBackend {
  readonly backend: LockBackend;
  readonly hooks?: LockManagerHooks;
  close(): Promise<void>;
}

/** Opens `config.kind`'s backend with clients of its own; `close()` closes the backend, then the clients. */
export async function openBackend(config: BackendConfig): Promise<OpenBackend> {
  const client = postgres(config.databaseUrl, { max: 4, onnotice: () => {} });
  const closers: (() => Promise<unknown>)[] = [() => client.end({ timeout: 5 })];
  let backend: LockBackend;
  let hooks: LockManagerHooks = {};
  switch (config.kind) {
    case 'postgres':
      backend = postgresLockBackend({ client: drizzle(client), namespace: config.namespace });
      hooks = { waitGraceMs: SERVER_WAIT_GRACE_MS };
      break;
    case 'advisory':
      backend = advisoryLockBackend({ client, namespace: config.namespace });
      hooks = { waitGraceMs: SERVER_WAIT_GRACE_MS };
      break;
    case 'redis': {
      if (!config.redisUrl) throw new Error('the redis backend needs redisUrl');
      const redis = new Redis(config.redisUrl, { commandTimeout: 2_000, maxRetriesPerRequest: 1 });
      redis.on('error', () => {}); // reconnects by itself; commands fail (bounded) meanwhile
      closers.unshift(async () => redis.disconnect());
      const options = { client: redis, namespace: config.namespace, epochs: drizzle(client) };
      // As redisLockManager builds it: grants carry their epoch's fence source, the namespace makes the lock.
      backend = forwardTo(redisLockBackend(options), config.namespace);
      break;
    }
    case 'etcd': {
      if (!config.etcdEndpoints?.length) throw new Error('the etcd backend needs etcdEndpoints');
      // Loaded only here: etcd3 (and gRPC) is an optional peer dependency.
      const { Etcd3 } = await import('etcd3');
      const { etcdLockBackend } = await import('../../src/fencing/backends/etcd/backend.js');
      const etcd = new Etcd3({ hosts: [...config.etcdEndpoints] });
      closers.unshift(async () => etcd.close());
      // As etcdLockManager builds it: grants carry the cluster id, for leases' lock identity.
      backend = forwardTo(etcdLockBackend({ client: etcd, namespace: config.namespace }), config.namespace);
      break;
    }
    default:
      throw new Error(`backend ${String(config.kind)} is not wired into test/support/lock-backends.ts`);
  }
  return {
    backend,
    hooks,
    async close() {
      await backend.close();
      for (const close of closers) await close();
    },
  };
}

/**
 * The contract for a built-in backend: every `open()` takes a namespace of
 * its own in the stores `where()` names (read when a check starts, so a
 * test file may start them in `beforeAll`).
 */
export function builtInContract(
  kind: BackendKind,
  where: () => Omit<BackendConfig, 'kind' | 'namespace'>,
): LockBackendContract {
  return {
    processModule: fileURLToPath(import.meta.url),
    async open(): Promise<ContractSubject> {
      const config: BackendConfig = { ...where(), kind, namespace: uniqueNamespace(kind) };
      const opened = await openBackend(config);
      const admin = postgres(config.databaseUrl, { max: 1, onnotice: () => {} });
      return {
        backend: opened.backend,
        hooks: opened.hooks,
        processOptions: config,
        // Advisory locks have no TTL: a lease is lost when its session ends.
        ...(kind === 'advisory' ? { loseLease: (name: string) => terminateHolder(admin, config.namespace, name) } : {}),
        async dispose() {
          await opened.close();
          await admin.end({ timeout: 5 });
          if (config.redisUrl && kind === 'redis') await deleteRedisNamespace(config.redisUrl, config.namespace);
        },
      };
    },
  };
}

/** Ends the Postgres session holding `name`'s advisory lock (pg_terminate_backend). */
async function terminateHolder(admin: postgres.Sql, namespace: string, name: string): Promise<void> {
  const { classid, objid } = advisoryKeyParts(advisoryKey(namespace, name));
  const rows = await execute(
    drizzle(admin),
    sql`select pg_terminate_backend(pid) as done from pg_locks where locktype = 'advisory' and granted
        and objsubid = 1 and classid = ${classid.toString()}::oid and objid = ${objid.toString()}::oid`,
  );
  if (rows.length !== 1) throw new Error(`expected one session holding ${name}, found ${rows.length}`);
}

/** Deletes the namespace's Redis keys (bounded SCAN), so runs leave nothing behind. */
async function deleteRedisNamespace(url: string, namespace: string): Promise<void> {
  const redis = new Redis(url, { commandTimeout: 2_000, maxRetriesPerRequest: 1 });
  redis.on('error', () => {});
  try {
    let cursor = '0';
    for (let i = 0; i < 1_000; i++) {
      const [next, keys] = await redis.scan(cursor, 'MATCH', `{palisade:${namespace}}*`, 'COUNT', 1000);
      if (keys.length > 0) await redis.del(...keys);
      cursor = next;
      if (cursor === '0') break;
    }
  } finally {
    redis.disconnect();
  }
}
