/**
 * One worker process of `palisade demo`. It holds its own connections and
 * its own lock client, exactly like a replica of a service would, and does
 * one step at a time when the demo tells it to (JSON lines on stdin), so the
 * demo can pause it (SIGSTOP) at the worst moment. It answers each command
 * with one JSON line on stdout. Nothing imports it; the demo spawns it.
 */
import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { createInterface } from 'node:readline';
import { eq } from 'drizzle-orm';
import type { Redis } from 'ioredis';
import { type Database, translateError } from '../driver.js';
import { postgresLockManager } from '../fencing/backends/postgres-lease/backend.js';
import { redisLockManager } from '../fencing/backends/redis/manager.js';
import type { Lease } from '../fencing/lease.js';
import type { LockManager } from '../fencing/lock-manager.js';
import { fencedRepository } from '../repo/repository.js';
import { demoCounter, postgresOptions, type WorkerCommand, type WorkerConfig } from './demo-shared.js';

const config = JSON.parse(process.argv[2] ?? '{}') as WorkerConfig;
const holder = `worker ${config.label} (pid ${process.pid})`;

// Optional peers of the library, loaded here (the demo checked postgres.js before spawning us).
const { default: postgres } = await import('postgres');
const { drizzle } = await import('drizzle-orm/postgres-js');
const client =
  config.connection.kind === 'url'
    ? postgres(config.connection.url, postgresOptions(config.connection))
    : postgres(postgresOptions(config.connection));
const db = drizzle(client) as unknown as Database;
const redis: Redis | undefined = config.redisUrl
  ? new (await import('ioredis')).Redis(config.redisUrl, {
      commandTimeout: 2000,
      maxRetriesPerRequest: 1,
      lazyConnect: true,
    })
  : undefined;
const manager: LockManager = redis
  ? redisLockManager({ client: redis, namespace: config.namespace, epochs: db })
  : // No LISTEN connection: each worker keeps to one connection; waiters poll.
    postgresLockManager({ client: db, namespace: config.namespace, listen: false });
const repo = fencedRepository(db, demoCounter);

// The naive lock: a correct TTL lock (unique token, SET NX PX, token-checked
// release) — and no fence. On Postgres, the same thing as one statement.
const naiveKey = `palisade-demo:${config.namespace}:naive:${config.lock}`;
let naiveToken: string | undefined;
let lease: Lease | undefined;

async function naiveTryAcquire(token: string): Promise<boolean> {
  if (redis) return (await redis.set(naiveKey, token, 'PX', config.ttlMs, 'NX')) === 'OK';
  const rows = await client`
    insert into palisade_demo_naive_locks (name, token, expires_at)
    values (${naiveKey}, ${token}, clock_timestamp() + ${config.ttlMs} * interval '1 millisecond')
    on conflict (name) do update set token = excluded.token, expires_at = excluded.expires_at
      where palisade_demo_naive_locks.expires_at <= clock_timestamp()
    returning 1`;
  return rows.length === 1;
}

async function naiveRelease(token: string): Promise<boolean> {
  if (redis) {
    const script = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";
    return Number(await redis.eval(script, 1, naiveKey, token)) === 1;
  }
  const rows = await client`
    delete from palisade_demo_naive_locks
    where name = ${naiveKey} and token = ${token} and expires_at > clock_timestamp() returning 1`;
  return rows.length === 1;
}

const handlers: {
  [K in WorkerCommand['cmd']]: (c: Extract<WorkerCommand, { cmd: K }>) => Promise<Record<string, unknown>>;
} = {
  async 'naive-acquire'(c) {
    const token = randomBytes(16).toString('hex');
    const deadline = performance.now() + c.waitMs;
    // Bounded: until the deadline, at most 2,000 attempts, 25 ms apart.
    for (let attempt = 0; attempt < 2000; attempt++) {
      if (await naiveTryAcquire(token)) {
        naiveToken = token;
        return { acquired: true, attempts: attempt + 1 };
      }
      if (performance.now() >= deadline) break;
      await new Promise((r) => setTimeout(r, 25));
    }
    return { acquired: false };
  },
  async 'naive-release'() {
    if (!naiveToken) throw new Error('naive-release before naive-acquire');
    return { released: await naiveRelease(naiveToken) };
  },
  async read(c) {
    const [row] = await db.select().from(demoCounter).where(eq(demoCounter.id, c.row));
    if (!row) throw new Error(`no counter row ${c.row}`);
    return { visits: row.visits, fence: row.lastFence };
  },
  async 'naive-write'(c) {
    // What a lock without a fence leaves you: a plain UPDATE.
    const rows = await db
      .update(demoCounter)
      .set({ visits: c.visits })
      .where(eq(demoCounter.id, c.row))
      .returning({ id: demoCounter.id });
    return { rows: rows.length };
  },
  async acquire(c) {
    lease = await manager.acquire(config.lock, { ttlMs: config.ttlMs, waitMs: c.waitMs, holder, autoExtend: true });
    return { fence: lease.fence };
  },
  async 'fenced-write'(c) {
    if (!lease) throw new Error('fenced-write before acquire');
    // The lease's fence goes straight to the database: the database decides.
    const result = await repo.update({ id: c.row }, lease.fence, { visits: c.visits });
    return { status: result.status, currentFence: result.status === 'stale' ? result.currentFence : null };
  },
  async increment(c) {
    if (!lease) throw new Error('increment before acquire');
    // Safe read-modify-write: row lock + fenced write in one transaction.
    const result = await repo.modify({ id: c.row }, lease.fence, (row) => ({ visits: row.visits + 1 }));
    return { status: result.status, visits: result.status === 'applied' ? result.row.visits : null };
  },
  async 'lease-state'() {
    if (!lease) throw new Error('lease-state before acquire');
    const reason = lease.signal.aborted ? lease.signal.reason : undefined;
    return { lost: lease.signal.aborted, reason: reason instanceof Error ? reason.message : null };
  },
  async release() {
    if (!lease) throw new Error('release before acquire');
    return { result: await lease.release() };
  },
  async ping() {
    // The first query opens the connection: the demo starts the workers before the database is up.
    if (redis && redis.status === 'wait') await redis.connect();
    await client`select 1`;
    return {};
  },
  async exit() {
    return {};
  },
};

const reply = (message: Record<string, unknown>) =>
  process.stdout.write(`${JSON.stringify(message, (_k, v) => (typeof v === 'bigint' ? v.toString() : v))}\n`);

async function shutdown(): Promise<void> {
  await manager.close().catch(() => {});
  redis?.disconnect();
  await client.end({ timeout: 2 }).catch(() => {});
}

reply({ id: 0, ok: true, ready: true, pid: process.pid });

for await (const line of createInterface({ input: process.stdin })) {
  const command = JSON.parse(line) as WorkerCommand;
  try {
    const handler = handlers[command.cmd] as (c: WorkerCommand) => Promise<Record<string, unknown>>;
    reply({ id: command.id, ok: true, ...(await handler(command)) });
  } catch (err) {
    reply({ id: command.id, ok: false, error: translateError(err).message });
  }
  if (command.cmd === 'exit') break;
}
await shutdown();
process.exit(0);
