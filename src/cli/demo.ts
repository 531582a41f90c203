/**
 * `palisade demo`: the course module's story, told with real processes.
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
import { type ChildProcess, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { sql } from 'drizzle-orm';
import type { Database } from '../driver.js';
import { execute, int8 } from '../driver.js';
import { CliError } from '../errors.js';
import { migrate } from '../migrate.js';
import { type Command, describeUrl, type Io, loadCliPeer, parse } from './common.js';
import type { DemoConnection, WorkerCommand, WorkerConfig } from './demo-shared.js';

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

const STEP_TIMEOUT_MS = 30_000;

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

/**
 * A place where the story runs: the database the workers share. Its
 * connection settings are known before it starts, so the worker processes
 * boot while the database does.
 */
interface Stage {
  readonly connection: DemoConnection;
  readonly description: string;
  start(): Promise<Database>;
  close(): Promise<void>;
}

function embeddedStage(): Stage {
  const dir = mkdtempSync(join(tmpdir(), 'palisade-demo-'));
  const port = 5432;
  const path = join(dir, `.s.PGSQL.${port}`);
  let stop = async () => {};
  return {
    connection: { kind: 'socket', dir, port },
    description: `embedded PGlite, served to the worker processes on the unix socket ${path}`,
    async start() {
      // Optional peers of the library; a clone has them (devDependencies).
      const [{ PGlite }, { PGLiteSocketServer }, { drizzle }] = await Promise.all([
        loadCliPeer<typeof import('@electric-sql/pglite')>('@electric-sql/pglite'),
        loadCliPeer<typeof import('@electric-sql/pglite-socket')>('@electric-sql/pglite-socket'),
        loadCliPeer<typeof import('drizzle-orm/pglite')>('drizzle-orm/pglite'),
        loadCliPeer<typeof import('postgres')>('postgres'), // the workers connect with postgres.js
      ]);
      const pglite = new PGlite();
      // Two workers with one connection each; a little room for a reconnect.
      const server = new PGLiteSocketServer({ db: pglite, path, maxConnections: 4 });
      stop = async () => {
        await server.stop().catch(() => {});
        await pglite.close().catch(() => {});
      };
      await server.start();
      return drizzle(pglite) as unknown as Database;
    },
    async close() {
      await stop();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

function postgresStage(url: string): Stage {
  const schema = `palisade_demo_${randomBytes(4).toString('hex')}`;
  let stop = async () => {};
  return {
    connection: { kind: 'url', url, schema },
    description: `the Postgres at DATABASE_URL (${describeUrl(url)}); demo tables in the temporary schema ${schema}`,
    async start() {
      const [{ default: postgres }, { drizzle }] = await Promise.all([
        loadCliPeer<{ default: typeof import('postgres') }>('postgres'),
        loadCliPeer<typeof import('drizzle-orm/postgres-js')>('drizzle-orm/postgres-js'),
      ]);
      const client = postgres(url, {
        max: 1,
        connect_timeout: 10,
        onnotice: () => {},
        connection: { search_path: schema, application_name: 'palisade-demo' },
      });
      stop = () => client.end({ timeout: 5 }).catch(() => {});
      try {
        await client.unsafe(`create schema ${schema}`);
      } catch (err) {
        throw new CliError(
          `cannot use DATABASE_URL (${describeUrl(url)}): ${err instanceof Error ? err.message : String(err)}`,
        );
      }
      stop = async () => {
        await client.unsafe(`drop schema if exists ${schema} cascade`).catch(() => {});
        await client.end({ timeout: 5 }).catch(() => {});
      };
      return drizzle(client) as unknown as Database;
    },
    close: () => stop(),
  };
}

/** A demo worker process, driven one command at a time. */
class DemoWorker {
  readonly child: ChildProcess;
  readonly ready: Promise<void>;
  readonly #replies = new Map<number, (reply: Record<string, unknown>) => void>();
  #nextId = 1;
  #stderr = '';
  #exited = false;
  readonly exited: Promise<void>;

  constructor(
    readonly label: string,
    config: WorkerConfig,
  ) {
    const { args } = workerEntry();
    this.child = spawn(process.execPath, [...args, JSON.stringify(config)], {
      stdio: ['pipe', 'pipe', 'pipe'],
      env: process.env,
    });
    live.add(this.child);
    this.child.stderr?.on('data', (chunk) => {
      this.#stderr = (this.#stderr + String(chunk)).slice(-2000);
    });
    createInterface({ input: this.child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
      let message: Record<string, unknown>;
      try {
        message = JSON.parse(line) as Record<string, unknown>;
      } catch {
        return;
      }
      const id = Number(message.id);
      this.#replies.get(id)?.(message);
      this.#replies.delete(id);
    });
    this.exited = new Promise((resolve) =>
      this.child.on('exit', () => {
        this.#exited = true;
        live.delete(this.child);
        for (const wake of this.#replies.values()) wake({ ok: false, error: `worker ${label} exited` });
        this.#replies.clear();
        resolve();
      }),
    );
    this.ready = this.#await(0).then(() => undefined);
  }

  get pid(): number {
    return this.child.pid ?? -1;
  }

  #await(id: number): Promise<Record<string, unknown>> {
    return new Promise((resolve, reject) => {
      if (this.#exited) {
        reject(this.#failure('exited'));
        return;
      }
      const timer = setTimeout(() => {
        this.#replies.delete(id);
        reject(this.#failure(`did not answer within ${STEP_TIMEOUT_MS / 1000} s`));
      }, STEP_TIMEOUT_MS);
      this.#replies.set(id, (reply) => {
        clearTimeout(timer);
        if (reply.ok === true) resolve(reply);
        else reject(this.#failure(String(reply.error)));
      });
    });
  }

  #failure(what: string): CliError {
    const detail = this.#stderr.trim().split('\n').at(-1);
    return new CliError(`worker ${this.label} ${what}${detail ? ` (${detail})` : ''}`);
  }

  /** Sends one command and resolves with the worker's answer. */
  call<C extends WorkerCommand['cmd']>(
    cmd: C,
    params: Omit<Extract<WorkerCommand, { cmd: C }>, 'id' | 'cmd'> = {} as never,
  ): Promise<Record<string, unknown>> {
    const id = this.#nextId++;
    const answer = this.#await(id);
    this.child.stdin?.write(`${JSON.stringify({ id, cmd, ...params })}\n`);
    return answer;
  }

  pause(): void {
    this.child.kill('SIGSTOP');
  }

  resume(): void {
    this.child.kill('SIGCONT');
  }

  /** Asks the worker to exit; kills it if it has not within 5 s. */
  async stop(): Promise<void> {
    if (this.#exited) return;
    this.resume();
    this.child.stdin?.write(`${JSON.stringify({ id: this.#nextId++, cmd: 'exit' })}\n`);
    const timer = setTimeout(() => this.child.kill('SIGKILL'), 5000);
    await this.exited;
    clearTimeout(timer);
  }
}

// Workers still running when the demo ends for any reason: never leave one stopped.
const live = new Set<ChildProcess>();
function killLive(): void {
  for (const child of live) {
    child.kill('SIGCONT');
    child.kill('SIGKILL');
  }
}

/** How to start the worker: its compiled file, or its TypeScript source through tsx. */
function workerEntry(): { args: string[] } {
  const fromSource = import.meta.url.endsWith('.ts');
  const file = fileURLToPath(new URL(fromSource ? './demo-worker.ts' : './demo-worker.js', import.meta.url));
  return { args: fromSource ? ['--import', import.meta.resolve('tsx'), file] : [file] };
}

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
    await redis.del(
      keys.fence,
      keys.lock('counter'),
      keys.grant('counter'),
      `palisade-demo:${namespace}:naive:counter`,
    );
  } catch {
    // Best effort: the keys are small and the lock keys expire.
  } finally {
    redis.disconnect();
  }
}

/** Prints the story with the time since the act began. */
class Timeline {
  #start = performance.now();
  constructor(private readonly io: Io) {}

  restart(): void {
    this.#start = performance.now();
  }

  say(who: string, text: string): void {
    const t = ((performance.now() - this.#start) / 1000).toFixed(2).padStart(5);
    this.io.out(`  ${t}s  ${who.padEnd(2)} ${text}`);
  }
}

async function readCounter(db: Database, row: number): Promise<{ visits: number; fence: bigint }> {
  const [r] = await execute(db, sql`select visits, last_fence from palisade_demo_counter where id = ${row}`);
  if (!r) throw new CliError(`counter row ${row} is missing`);
  return { visits: Number(r.visits), fence: int8(r.last_fence) ?? 0n };
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

async function actOne(io: Io, db: Database, a: DemoWorker, b: DemoWorker): Promise<{ visits: number }> {
  io.out('Act 1 — a correct TTL lock (unique token, SET NX with a TTL, token-checked release), no fence');
  const t = new Timeline(io);
  const row = 1;
  const got = await a.call('naive-acquire', { waitMs: 0 });
  if (got.acquired !== true) throw new CliError('worker A could not take the naive lock');
  t.say('A', 'took the lock "counter"');
  const aRead = Number((await a.call('read', { row })).visits);
  t.say('A', `read visits = ${aRead}; will write ${aRead + 1}`);
  a.pause();
  const pausedAt = performance.now();
  t.say('⏸', `A paused (SIGSTOP) — a GC pause, a throttled CPU, a slow disk…`);
  const bGot = await b.call('naive-acquire', { waitMs: STEP_TIMEOUT_MS - 5000 });
  if (bGot.acquired !== true) throw new CliError("worker B could not take the naive lock after A's lease expired");
  t.say('B', 'took the lock "counter": A\'s lease had expired while A was paused');
  const bRead = Number((await b.call('read', { row })).visits);
  await b.call('naive-write', { row, visits: bRead + 1 });
  t.say('B', `read visits = ${bRead}, wrote visits = ${bRead + 1}`);
  await b.call('naive-release');
  t.say('B', 'released the lock');
  a.resume();
  t.say(
    '▶',
    `A resumed (SIGCONT) after ${((performance.now() - pausedAt) / 1000).toFixed(1)} s; it still believes it holds the lock`,
  );
  const wrote = await a.call('naive-write', { row, visits: aRead + 1 });
  t.say(
    'A',
    `wrote visits = ${aRead + 1} — ${Number(wrote.rows) === 1 ? 'it landed: nothing checked that A still held the lock' : 'it did not land'}`,
  );
  const released = await a.call('naive-release');
  t.say(
    'A',
    released.released === true
      ? 'released the lock'
      : "release found the lock gone (the token check kept A from deleting another's lock) — but the write already landed",
  );
  const final = await readCounter(db, row);
  io.out(
    `  result: visits = ${final.visits} after two increments — expected 2${final.visits === 2 ? '' : ". B's increment was lost."}\n`,
  );
  return { visits: final.visits };
}

async function actTwo(
  io: Io,
  db: Database,
  a: DemoWorker,
  b: DemoWorker,
): Promise<{ visits: number; ok: boolean; staleFence: string; winningFence: string }> {
  io.out('Act 2 — palisade: every lease carries a fence, every write is fenced');
  const t = new Timeline(io);
  const row = 2;
  const aFence = String((await a.call('acquire', { waitMs: 10_000 })).fence);
  t.say('A', `took the lock "counter" with fence ${aFence} (watchdog on: it extends the lease while A runs)`);
  const aRead = Number((await a.call('read', { row })).visits);
  t.say('A', `read visits = ${aRead}; will write ${aRead + 1}`);
  a.pause();
  const pausedAt = performance.now();
  t.say('⏸', 'A paused (SIGSTOP) — a paused process cannot run its watchdog either');
  const bFence = String((await b.call('acquire', { waitMs: STEP_TIMEOUT_MS - 5000 })).fence);
  t.say('B', `took the lock "counter" with fence ${bFence}: A's lease had expired`);
  const bRead = Number((await b.call('read', { row })).visits);
  const bWrite = await b.call('fenced-write', { row, visits: bRead + 1 });
  t.say('B', `read visits = ${bRead}, wrote visits = ${bRead + 1} with fence ${bFence}: ${String(bWrite.status)}`);
  await b.call('release');
  t.say('B', 'released the lock');
  a.resume();
  t.say('▶', `A resumed (SIGCONT) after ${((performance.now() - pausedAt) / 1000).toFixed(1)} s`);
  const aWrite = await a.call('fenced-write', { row, visits: aRead + 1 });
  const refused = aWrite.status === 'stale';
  t.say(
    'A',
    refused
      ? `wrote visits = ${aRead + 1} with fence ${aFence} — REFUSED by Postgres: stale (the row carries fence ${String(aWrite.currentFence)})`
      : `wrote visits = ${aRead + 1} with fence ${aFence}: ${String(aWrite.status)}`,
  );
  const state = await a.call('lease-state');
  if (state.lost === true) t.say('A', "its lease's signal has fired too: it knows it lost the lock");
  await a.call('release');
  const retryFence = String((await a.call('acquire', { waitMs: 10_000 })).fence);
  const inc = await a.call('increment', { row });
  t.say('A', `took the lock again with fence ${retryFence}; safe read-modify-write → visits = ${String(inc.visits)}`);
  await a.call('release');
  t.say('A', 'released the lock');
  const final = await readCounter(db, row);
  const ok = refused && final.visits === 2 && String(final.fence) === retryFence;
  io.out(
    `  result: visits = ${final.visits} after two increments — ${final.visits === 2 ? 'right' : 'WRONG'}; the row's fence is ${final.fence}; the stale write never landed`,
  );
  return { visits: final.visits, ok, staleFence: aFence, winningFence: bFence };
}
