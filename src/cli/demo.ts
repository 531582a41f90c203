/**
 * `palisade demo`: the README's "What `npm run demo` shows", told with real
 * processes.
 *
 * Two worker processes each add 1 to a counter row while holding a lock.
 * Worker A is paused (SIGSTOP) right after reading — a GC pause, a CPU
 * throttle — until its lease has expired; B takes the lock and writes; A
 * wakes (SIGCONT) and writes what it computed before the pause.
 *
 * - Act 1, a correct TTL lock without a fence: A's late write lands and an
 *   increment is lost, silently.
 * - Act 2, palisade: A's write carries fence n, the row already carries
 *   n+1, and Postgres refuses it; A learns it, retakes the lock and
 *   increments safely. The counter is right.
 *
 * With no configuration everything runs on an embedded PGlite served to the
 * workers over a unix socket; DATABASE_URL and REDIS_URL switch to real
 * servers.
 */
import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { sql } from 'drizzle-orm';
import { execute } from '../driver.js';
import { CliError } from '../errors.js';
import { migrate } from '../migrate.js';
import { type Command, describeUrl, type Io, parse, requireCliPeers } from './common.js';
import { actOne, actTwo } from './demo-acts.js';
import { EMBEDDED_PEERS, embeddedStage, POSTGRES_PEERS, postgresStage } from './demo-stages.js';
import { DemoWorker, killLive } from './demo-workers.js';

const help = `Usage: palisade demo [--ttl MS]

Shows, with two real worker processes, why a lock alone cannot protect a write
and how palisade's fences do: worker A takes the lock, reads a counter, and is
paused (SIGSTOP) until its lease expires; worker B takes the lock and writes;
A resumes and writes too.
  Act 1: a correct TTL lock without a fence — A's late write lands, an update is lost.
  Act 2: palisade — A's write carries an old fence and Postgres refuses it.

Needs no server: by default it runs on an embedded PGlite, served to the worker
processes over a unix socket, with fences from a Postgres sequence.

Options:
  --ttl MS    lease time to live in milliseconds (default 1000; 200 … 10000)
  -h, --help  this help

Environment (optional):
  DATABASE_URL  run on this Postgres instead (palisade's tables are migrated into
                it; the demo's own tables live in a temporary schema, dropped after)
  REDIS_URL     take locks and fences from this Redis (fence floor in Postgres)

Exit codes: 0 the story ran and palisade kept the counter right, 1 otherwise.`;

export const demoCommand: Command = {
  summary: 'see it work: a lock without a fence loses an update; palisade refuses the stale write',
  help,
  async run(argv, io) {
    const { values } = parse('demo', argv, { ttl: { type: 'string' } });
    if (values.help) {
      io.out(help);
      return 0;
    }
    const ttlMs = values.ttl === undefined ? 1000 : Number(values.ttl);
    if (!Number.isInteger(ttlMs) || ttlMs < 200 || ttlMs > 10_000) {
      throw new CliError('--ttl must be an integer number of milliseconds in 200 … 10000', 2);
    }
    return runDemo(io, ttlMs);
  },
};

/** Removes what the demo left in Redis: its namespace's keys (the naive lock key expires by itself). */
async function cleanRedis(url: string, namespace: string): Promise<void> {
  const [{ Redis }, { redisKeyNames }] = await Promise.all([
    import('ioredis'),
    import('../fencing/backends/redis/backend.js'),
  ]);
  const redis = new Redis(url, { commandTimeout: 2000, maxRetriesPerRequest: 1, lazyConnect: true });
  try {
    await redis.connect();
    const keys = redisKeyNames(namespace);
    await redis.del(keys.fence, keys.lock('counter'), `palisade-demo:${namespace}:naive:counter`);
  } catch {
    // Best effort: the keys are small and the lock keys expire.
  } finally {
    redis.disconnect();
  }
}

async function runDemo(io: Io, ttlMs: number): Promise<number> {
  const began = performance.now();
  const url = io.env.DATABASE_URL || undefined;
  const redisUrl = io.env.REDIS_URL || undefined;
  const onSignal = () => {
    killLive();
    process.exit(130);
  };
  process.once('SIGINT', onSignal);
  process.once('SIGTERM', onSignal);
  process.once('exit', killLive);

  // Every package the run will load, checked before anything starts (the workers would otherwise die on a missing one).
  await requireCliPeers([...(url ? POSTGRES_PEERS : EMBEDDED_PEERS), ...(redisUrl ? (['ioredis'] as const) : [])]);
  io.out('palisade demo — a lock tells a worker "you may write"; it cannot tell it "you still may".\n');
  const stage = url ? postgresStage(url) : embeddedStage();
  const namespace = `demo-${randomBytes(4).toString('hex')}`;
  const workers: DemoWorker[] = [];
  try {
    io.out(`database: ${stage.description}`);
    io.out(
      redisUrl
        ? `locks:    Redis at REDIS_URL (${describeUrl(redisUrl)}): SET NX PX; palisade fences from the Redis counter\n` +
            '          (a Redis fence is epoch × 2^39 + counter; the epoch comes from Postgres, so fences survive a Redis reset)'
        : 'locks:    Postgres leases (palisade.leases); palisade fences from the sequence palisade.fence_seq',
    );
    if (url) io.out("          (palisade's own tables are migrated into this database if missing)");
    const base = { connection: stage.connection, namespace, lock: 'counter', ttlMs, ...(redisUrl ? { redisUrl } : {}) };
    io.out('starting the database and two worker processes…');
    workers.push(new DemoWorker('A', { ...base, label: 'A' }), new DemoWorker('B', { ...base, label: 'B' }));
    const db = await stage.start();
    await migrate(db);
    await execute(
      db,
      sql`create table palisade_demo_counter (id integer primary key, visits integer not null,
        last_fence bigint not null default 0, deleted_at timestamptz)`,
    );
    await execute(
      db,
      sql`create table palisade_demo_naive_locks (name text primary key, token text not null, expires_at timestamptz not null)`,
    );
    await execute(db, sql`insert into palisade_demo_counter (id, visits) values (1, 0), (2, 0)`);
    await Promise.all(workers.map((w) => w.ready));
    // One at a time: the PGlite socket serves one session to every connection.
    for (const w of workers) await w.call('ping');
    const [a, b] = workers as [DemoWorker, DemoWorker];
    io.out(`worker A is pid ${a.pid}, worker B is pid ${b.pid}; lease TTL ${(ttlMs / 1000).toFixed(1)} s\n`);
    io.out('Each worker: take the lock "counter", read visits, add 1, write it back, release.');
    io.out('A is paused (SIGSTOP) between its read and its write, until its lease has expired.\n');

    const naive = await actOne(io, db, a, b);
    const fenced = await actTwo(io, db, a, b);

    io.out('\nSummary');
    io.out(
      `  lock without a fence  visits = ${naive.visits} after 2 increments  ${naive.visits === 2 ? 'ok (this time)' : '✗ an update was lost, and nobody was told'}`,
    );
    io.out(
      `  palisade              visits = ${fenced.visits} after 2 increments  ${fenced.ok ? '✓' : '✗'} the stale write was refused by Postgres (fence ${fenced.staleFence} < ${fenced.winningFence})`,
    );
    io.out('\nA lock alone is an efficiency lock. A fence checked by the resource makes it a correctness lock.');
    io.out(`(demo took ${((performance.now() - began) / 1000).toFixed(1)} s)`);
    if (!fenced.ok) {
      io.err('palisade demo: the fenced counter is not right — this is a bug, please report it');
      return 1;
    }
    return 0;
  } finally {
    await Promise.all(workers.map((w) => w.stop()));
    killLive();
    await stage.close();
    if (redisUrl) await cleanRedis(redisUrl, namespace);
    process.removeListener('SIGINT', onSignal);
    process.removeListener('SIGTERM', onSignal);
    process.removeListener('exit', killLive);
  }
}
