/**
 * The services a benchmark run uses, all on loopback and all of its own:
 *
 * - Postgres: a database created for the run on `DATABASE_URL` (default
 *   `postgres://postgres@127.0.0.1:5432/test`), dropped at the end.
 * - Redis: a `redis-server` started on a free loopback port, no persistence,
 *   so `INFO commandstats` counts only this run's commands and `FLUSHDB` is
 *   ours to use. Without a `redis-server` binary it falls back to
 *   `REDIS_URL` with a key prefix of its own (counts are then noisy).
 */
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { createServer } from 'node:net';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import type { Database } from '../../src/driver.js';

const DEFAULT_DATABASE_URL = 'postgres://postgres@127.0.0.1:5432/test';
const DEFAULT_REDIS_URL = 'redis://127.0.0.1:6379';

/** A Postgres database of the run's own. */
export interface BenchDatabase {
  readonly name: string;
  readonly url: string;
  /** postgres.js client, `max` connections (16 concurrent clients need 16+). */
  readonly sql: postgres.Sql;
  /** drizzle on `sql`. */
  readonly db: Database;
  /** Opens another postgres.js client on the same database (`connection`: server settings for its sessions). */
  client(max: number, connection?: Record<string, string>): postgres.Sql;
  close(): Promise<void>;
}

/** Creates `palisade_bench_<random>` on `DATABASE_URL`; `close()` drops it (with force). */
export async function benchDatabase(max = 20): Promise<BenchDatabase> {
  const base = process.env.DATABASE_URL ?? DEFAULT_DATABASE_URL;
  assertLoopback(base, 'DATABASE_URL');
  const name = `palisade_bench_${randomBytes(5).toString('hex')}`;
  const admin = postgres(base, { max: 1, onnotice: () => {} });
  await admin.unsafe(`create database ${name}`);
  const u = new URL(base);
  u.pathname = `/${name}`;
  const url = u.toString();
  const clients: postgres.Sql[] = [];
  const client = (n: number, connection?: Record<string, string>) => {
    const counter = { n: 0 };
    const c = postgres(url, {
      max: n,
      onnotice: () => {},
      // Counts every query the client sends (sessions derived from its options, like the advisory
      // backend's, count here too): exact round-trip counts, cheap enough to leave on.
      debug: () => {
        counter.n++;
      },
      ...(connection ? { connection } : {}),
    });
    queryCounts.set(c, counter);
    clients.push(c);
    return c;
  };
  const sql = client(max);
  return {
    name,
    url,
    sql,
    db: drizzle(sql) as unknown as Database,
    client,
    async close() {
      await Promise.allSettled(clients.map((c) => c.end({ timeout: 5 })));
      await admin.unsafe(`drop database if exists ${name} with (force)`);
      await admin.end({ timeout: 5 });
    },
  };
}

const queryCounts = new WeakMap<postgres.Sql, { n: number }>();

/** Queries sent so far by a client made with {@link BenchDatabase.client}. */
export function queriesSent(sql: postgres.Sql): number {
  return queryCounts.get(sql)?.n ?? 0;
}

/** A Redis of the run's own (or the shared one with a prefix). */
export interface BenchRedis {
  readonly url: string;
  /** True when this run started the server: commandstats are then exact. */
  readonly own: boolean;
  /** Key prefix to use for every name (empty on an own server). */
  readonly prefix: string;
  readonly version: string;
  /** A new ioredis client; closed by `close()`. */
  client(): Redis;
  /** `INFO commandstats` as command → calls. */
  commandStats(): Promise<Map<string, number>>;
  close(): Promise<void>;
}

/** Starts `redis-server` on a free loopback port (no persistence), or falls back to `REDIS_URL`. */
export async function benchRedis(): Promise<BenchRedis> {
  let child: ChildProcess | undefined;
  let url: string;
  let own = false;
  if (hasBinary('redis-server') && process.env.BENCH_SHARED_REDIS !== '1') {
    const port = await freePort();
    child = spawn(
      'redis-server',
      ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--loglevel', 'warning'],
      { stdio: 'ignore' },
    );
    url = `redis://127.0.0.1:${port}`;
    own = true;
    await waitForRedis(url);
  } else {
    url = process.env.REDIS_URL ?? DEFAULT_REDIS_URL;
    assertLoopback(url, 'REDIS_URL');
  }
  const clients: Redis[] = [];
  const client = () => {
    const c = new Redis(url, { lazyConnect: false, maxRetriesPerRequest: 1, commandTimeout: 10_000 });
    clients.push(c);
    return c;
  };
  const admin = client();
  const info = await admin.info('server');
  const version = /redis_version:(\S+)/.exec(info)?.[1] ?? 'unknown';
  return {
    url,
    own,
    prefix: own ? '' : `palisade-bench-${randomBytes(4).toString('hex')}:`,
    version,
    client,
    async commandStats() {
      const text = await admin.info('commandstats');
      const stats = new Map<string, number>();
      for (const m of text.matchAll(/^cmdstat_([^:]+):calls=(\d+)/gm)) stats.set(m[1] as string, Number(m[2]));
      return stats;
    },
    async close() {
      for (const c of clients) c.disconnect();
      if (child) {
        child.kill('SIGTERM');
        await new Promise((resolve) => {
          if (child?.exitCode !== null) resolve(undefined);
          else child.once('exit', resolve);
          setTimeout(resolve, 2_000).unref();
        });
      }
    },
  };
}

function hasBinary(name: string): boolean {
  try {
    execFileSync(name, ['--version'], { stdio: 'ignore' });
    return true;
  } catch {
    return false;
  }
}

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.unref();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      const port = typeof address === 'object' && address ? address.port : 0;
      server.close(() => resolve(port));
    });
  });
}

async function waitForRedis(url: string): Promise<void> {
  const deadline = Date.now() + 5_000;
  for (;;) {
    const probe = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
    probe.on('error', () => {}); // refused until the server listens: expected while polling
    try {
      await probe.connect();
      await probe.ping();
      probe.disconnect();
      return;
    } catch (err) {
      probe.disconnect();
      if (Date.now() > deadline) throw err;
      await new Promise((r) => setTimeout(r, 50));
    }
  }
}

function assertLoopback(url: string, what: string): void {
  const host = new URL(url).hostname;
  if (!['127.0.0.1', 'localhost', '::1', '[::1]'].includes(host)) {
    throw new Error(`${what} must point at loopback for a benchmark (got ${host})`);
  }
}
