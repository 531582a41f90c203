/**
 * One worker process of the chaos run (scripts/chaos.ts starts N of them).
 *
 * Loops, until told `stop` on stdin or its own time bound passes:
 * acquire the shared lock (bounded wait) → hold it for a random moment (the
 * window in which the runner's SIGSTOP makes it stale) → in ONE transaction,
 * `modify` the counter row (+1) with the lease's fence and, only if that
 * applied, append an audit row (after the fenced write, which holds the row
 * lock, so audit ids follow commit order) → release.
 *
 * It does NOT look at `lease.signal` before writing (unless `checkSignal`):
 * the point is that the database refuses a stale write, not that the worker
 * is polite. Every operation goes to the shared JSON Lines history
 * (invoke, then ok / fail / unknown); stdout carries short JSON messages the
 * runner uses to aim its faults (`acquired`, `writing`, `wrote`, `released`).
 *
 * With `namespaces` > 1 it runs one such loop per namespace at once (each
 * its own lock and counter row), so a Redis reset makes every namespace
 * recover its epoch together. With `redisPorts` (the replication nemesis) it
 * keeps a client and managers per Redis server and acquires on the one the
 * runner last named as primary (`{"primary": port}` on stdin); a runner that
 * tells some workers late leaves them granting on the old primary — the
 * split brain — and the history's `server` field says which server granted.
 *
 * argv[2]: JSON {@link ChaosWorkerArgs}.
 */
import { createInterface } from 'node:readline';
import { pathToFileURL } from 'node:url';
import { bigint, bigserial, integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import type { Database } from '../src/driver.js';
import { advisoryLockManager } from '../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../src/fencing/backends/postgres-lease/backend.js';
import { redisLockManager } from '../src/fencing/backends/redis/manager.js';
import type { Lease } from '../src/fencing/lease.js';
import type { LockManager } from '../src/fencing/lock-manager.js';
import { fencedTransaction } from '../src/repo/fenced-transaction.js';
import { fencedRepository } from '../src/repo/repository.js';
import { fenceColumns } from '../src/schema/fence-columns.js';
import { historyRecorder } from '../src/testing/history.js';
import type { BackendKind } from '../test/support/managers.js';
import { sleep } from '../test/support/sleep.js';

/** What the runner passes to each worker. */
export interface ChaosWorkerArgs {
  readonly kind: BackendKind;
  readonly namespace: string;
  readonly databaseUrl: string;
  readonly redisUrl?: string;
  /** Stable label: a restarted worker keeps it (the OS pid changes). */
  readonly process: string;
  readonly lock: string;
  /** The counter row's id. */
  readonly key: string;
  readonly ttlMs: number;
  readonly waitMs: number;
  /** The hold before the write lasts a random 0 … holdMs. */
  readonly holdMs: number;
  /** JSON Lines file shared by every worker. */
  readonly history: string;
  /** Skip the write when the lease's signal has fired (off by default: the database must refuse). */
  readonly checkSignal: boolean;
  /** The worker exits on its own after this long, even if never told to stop. */
  readonly maxRunMs: number;
  /** Redis only: this many namespaces (`<namespace>-<i>`, counter row `<key>-<i>`), one loop each (default 1: `namespace`, `key`). */
  readonly namespaces?: number;
  /** Redis only, the replication nemesis: the loopback ports of every Redis server, and the primary to start on. */
  readonly redisPorts?: readonly number[];
  readonly primary?: number;
  /** etcd only: every member's client URL (each through the worker's own proxy). */
  readonly etcdEndpoints?: readonly string[];
}

/** One lock and counter row a worker loop fights over. */
export interface ChaosSlot {
  readonly namespace: string;
  readonly lock: string;
  readonly key: string;
}

/** The (namespace, lock, counter row) of each loop, the same in the runner and its workers. */
export function chaosSlots(namespace: string, lock: string, key: string, namespaces = 1): ChaosSlot[] {
  if (namespaces <= 1) return [{ namespace, lock, key }];
  return Array.from({ length: namespaces }, (_, i) => ({
    namespace: `${namespace}-${i}`,
    lock: `${lock}:${i}`, // distinct in the history too, where holds of one lock name are compared
    key: `${key}-${i}`,
  }));
}

/** The shared counter: a fenced table. */
export const chaosCounter = pgTable('chaos_counter', {
  id: text('id').primaryKey(),
  n: integer('n').notNull().default(0),
  ...fenceColumns(),
});

/** One row per accepted increment, inserted after the fenced write in its transaction. */
export const chaosAudit = pgTable('chaos_audit', {
  id: bigserial('id', { mode: 'bigint' }).primaryKey(),
  key: text('key').notNull(),
  fence: bigint('fence', { mode: 'bigint' }).notNull(),
  process: text('process').notNull(),
  value: integer('value').notNull(),
  /** The lock (`namespace/name`) whose lease wrote: the checker's lock-scoped invariant is per lock. */
  lock: text('lock').notNull(),
});

/** The two rows one lock guards: every critical section writes both, alternating which goes first. */
export const chaosKeys = (key: string): [string, string] => [key, `${key}:b`];

/** The DDL the runner applies to each run's fresh database. */
export const CHAOS_DDL = [
  `create table chaos_counter (id text primary key, n integer not null default 0,
     last_fence bigint not null default 0, deleted_at timestamptz)`,
  `create table chaos_audit (id bigserial primary key, key text not null, fence bigint not null,
     process text not null, value integer not null, lock text not null)`,
];

/** Lock managers for each slot: on the one Redis (Postgres, etcd cluster) of the run, or on whichever server is the primary. */
interface Managers {
  readonly db: Database;
  /** The manager to acquire with now, and the server it talks to (replication nemesis only). */
  current(slot: ChaosSlot): { manager: LockManager; server?: string };
  close(): Promise<void>;
}

async function openManagers(args: ChaosWorkerArgs, slots: ChaosSlot[]): Promise<Managers> {
  if (args.kind === 'postgres' || args.kind === 'advisory') {
    // fetch_types: false, as the README advises for every postgres.js client: a kill at connect would
    // otherwise end the worker with the driver's unhandled rejection (test/repo/kill-at-connect.test.ts).
    const client = postgres(args.databaseUrl, { max: 4, fetch_types: false, onnotice: () => {} });
    const db = drizzle(client) as unknown as Database;
    // A partition freezes the worker's connections for 1.2–3 TTLs. With the defaults (5 s of server-side
    // lock wait, then 10 s of commandTimeoutMs) a frozen release would stay pending for 15 s, and a frozen
    // grant 10 s past its wait — long after the partition healed. With these a release ends within 2 TTLs
    // and a grant one TTL past its wait, with CommandTimeoutError (a bound under the manager's 2 s grace
    // past the wait, which would otherwise cut the attempt short first and report the service unreachable).
    const bounds = { lockTimeoutMs: args.ttlMs, commandTimeoutMs: args.ttlMs };
    const manager =
      args.kind === 'postgres'
        ? postgresLockManager({ client: db, namespace: args.namespace, ...bounds })
        : advisoryLockManager({ client, namespace: args.namespace, ...bounds });
    return {
      db,
      current: () => ({ manager }),
      async close() {
        await manager.close();
        await client.end({ timeout: 5 });
      },
    };
  }
  if (args.kind === 'etcd') return openEtcd(args);
  if (args.kind !== 'redis') throw new Error(`the chaos run has no ${args.kind} backend`);
  // One loop per namespace shares this pool: wide enough that a statement rarely waits past its bound for a connection.
  const client = postgres(args.databaseUrl, { max: slots.length > 1 ? 10 : 4, fetch_types: false, onnotice: () => {} });
  const db = drizzle(client) as unknown as Database;
  const ports = args.redisPorts ?? [Number(new URL(args.redisUrl ?? '').port)];
  const clients = new Map<number, Redis>();
  const managers = new Map<string, LockManager>();
  for (const port of ports) {
    const redis = new Redis(port, '127.0.0.1', { commandTimeout: 2_000, maxRetriesPerRequest: 1 });
    redis.on('error', () => {}); // reconnects by itself; commands fail (bounded) meanwhile
    clients.set(port, redis);
    for (const slot of slots) {
      managers.set(
        `${port} ${slot.namespace}`,
        redisLockManager({ client: redis, namespace: slot.namespace, epochs: db, commandTimeoutMs: 3_000 }),
      );
    }
  }
  let primary = args.primary ?? (ports[0] as number);
  createInterface({ input: process.stdin }).on('line', (line) => {
    if (!line.startsWith('{')) return;
    const told = (JSON.parse(line) as { primary?: unknown }).primary;
    if (typeof told === 'number' && clients.has(told)) primary = told;
  });
  return {
    db,
    current(slot) {
      const manager = managers.get(`${primary} ${slot.namespace}`) as LockManager;
      return args.redisPorts ? { manager, server: String(primary) } : { manager };
    },
    async close() {
      for (const manager of managers.values()) await manager.close().catch(() => {});
      for (const redis of clients.values()) redis.disconnect();
      await client.end({ timeout: 5 });
    },
  };
}

async function openEtcd(args: ChaosWorkerArgs): Promise<Managers> {
  const client = postgres(args.databaseUrl, { max: 4, fetch_types: false, onnotice: () => {} });
  const db = drizzle(client) as unknown as Database;
  // Loaded only here: etcd3 (and gRPC) is an optional peer dependency.
  const { Etcd3 } = await import('etcd3');
  const { etcdLockManager } = await import('../src/fencing/backends/etcd/manager.js');
  const etcd = new Etcd3({ hosts: [...(args.etcdEndpoints ?? [])], dialTimeout: 1_000 });
  // As on Postgres: a call frozen by a partition ends within a few TTLs rather than the 10 s default, and a
  // leader election (1–4 s with the cluster's 1 s election timeout) still fits in it.
  const manager = etcdLockManager({ client: etcd, namespace: args.namespace, commandTimeoutMs: 2 * args.ttlMs });
  return {
    db,
    current: () => ({ manager }),
    async close() {
      await manager.close().catch(() => {});
      etcd.close();
      await client.end({ timeout: 5 });
    },
  };
}

async function main(): Promise<void> {
  const args = JSON.parse(process.argv[2] ?? '{}') as ChaosWorkerArgs;
  const say = (event: string, data: Record<string, unknown> = {}) =>
    process.stdout.write(`${JSON.stringify({ event, ...data })}\n`);
  const codeOf = (err: unknown) => String((err as { code?: unknown })?.code ?? (err as Error)?.name ?? 'error');

  const slots = chaosSlots(args.namespace, args.lock, args.key, args.namespaces);
  // The history's "process" is one sequential loop: `w1`, or `w1.0`, `w1.1`, … with one loop per namespace.
  const labelOf = (i: number) => (slots.length > 1 ? `${args.process}.${i}` : args.process);
  for (let i = 0; i < slots.length; i++) historyRecorder(args.history, labelOf(i))({ type: 'ok', op: 'start' });
  const managers = await openManagers(args, slots);
  const { db } = managers;
  const stopAt = Date.now() + args.maxRunMs;
  let stopping = false;
  createInterface({ input: process.stdin }).on('line', (line) => {
    if (line.trim() === 'stop') stopping = true;
  });
  // Tell the runner which backend sessions to aim at, and that we are up.
  say('ready', { pid: process.pid });

  const loop = async (slot: ChaosSlot, i: number) => {
    const { lock, key } = slot;
    const label = labelOf(i);
    const record = historyRecorder(args.history, label);
    let round = 0;
    const unaborted = new AbortController().signal;
    while (!stopping && Date.now() < stopAt) {
      record({ type: 'invoke', op: 'acquire', lock });
      const { manager, server } = managers.current(slot);
      let lease: Lease;
      try {
        lease = await manager.acquire(lock, { ttlMs: args.ttlMs, waitMs: args.waitMs, holder: label });
      } catch (err) {
        const code = codeOf(err);
        // A bounded wait that ended is a certain failure; anything else (a dropped connection) may have granted.
        record({ type: code === 'lock_unavailable' ? 'fail' : 'unknown', op: 'acquire', lock, reason: code });
        if (code !== 'lock_unavailable') process.stderr.write(`acquire: ${String(err)}\n`);
        await sleep(20 + Math.random() * 80);
        continue;
      }
      const fence = lease.fence.toString();
      const source = lease.lock?.source;
      record({ type: 'ok', op: 'acquire', lock, fence, ...(source ? { source } : {}), ...(server ? { server } : {}) });
      say('acquired', { fence, ...(server ? { server } : {}) });

      await sleep(Math.random() * args.holdMs);

      if (args.checkSignal && lease.signal.aborted) {
        say('skipped', { fence });
      } else {
        // Lock scope: both rows in one fenced transaction, each write claiming the lock's register, so a
        // stale holder is refused on the row the newer holder has not written yet, too.
        // The hold is over: a pause from here lands in the write, not before it (the runner aims elsewhere).
        say('writing', { fence });
        const keys = chaosKeys(key);
        if (round++ % 2 === 1) keys.reverse();
        for (const k of keys) record({ type: 'invoke', op: 'increment', key: k, fence });
        const written: { key: string; n: number }[] = [];
        try {
          // The holder goes on as if it still held the lock (its signal is not consulted): the database
          // alone must refuse it. The idle timeout stays at one TTL, so a paused holder cannot wedge the lock.
          const holder = { fence: lease.fence, lock: lease.lock, signal: unaborted };
          const result = await fencedTransaction(
            db,
            holder,
            async (tx) => {
              for (const k of keys) {
                const r = await fencedRepository(db, chaosCounter)
                  .with(holder)
                  .modify({ id: k }, (row) => ({ n: row.n + 1 }));
                if (r.status !== 'applied') return r.status;
                // Named with its source: fences of two sources are never compared (the runner changes the id).
                const lockLabel = `${lease.lock?.source}:${slot.namespace}/${lock}`;
                await tx
                  .insert(chaosAudit)
                  .values({ key: k, fence: lease.fence, process: label, value: r.row.n, lock: lockLabel });
                written.push({ key: k, n: r.row.n });
              }
              return 'applied';
            },
            { idleTimeoutMs: args.ttlMs },
          );
          const status = result.status === 'applied' ? result.value : result.status;
          for (const k of keys) {
            if (status === 'applied') {
              const value = written.find((w) => w.key === k)?.n;
              record({ type: 'ok', op: 'increment', key: k, fence, ...(value === undefined ? {} : { value }) });
            } else
              record({
                type: 'fail',
                op: 'increment',
                key: k,
                fence,
                reason: status === 'duplicate' ? 'duplicate' : 'stale',
              });
          }
          say('wrote', { fence, status });
        } catch (err) {
          const code = codeOf(err);
          // `retryable` (40001/40P01) rolled back: certainly not applied. Anything else: the commit may have landed.
          for (const k of keys) {
            record({ type: code === 'retryable' ? 'fail' : 'unknown', op: 'increment', key: k, fence, reason: code });
          }
          say('wrote', { fence, status: code });
        }
      }

      record({ type: 'invoke', op: 'release', lock, fence });
      try {
        const released = await lease.release();
        record({ type: 'ok', op: 'release', lock, fence, reason: released });
      } catch (err) {
        record({ type: 'unknown', op: 'release', lock, fence, reason: codeOf(err) });
      }
      say('released', { fence });
      // Many loops in one process: a pause between rounds keeps the machine (and Postgres) breathing.
      if (slots.length > 1) await sleep(50 + Math.random() * 150);
    }
  };
  await Promise.all(slots.map(loop));

  await managers.close();
  say('exit');
  process.exit(0);
}

// Only as a process of its own: the runner imports the table definitions.
if (process.argv[1] && pathToFileURL(process.argv[1]).href === import.meta.url) {
  await main();
}
