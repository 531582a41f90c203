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
import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import type { Database } from '../../src/driver.js';
import { type PrivateRedis, startPrivateRedis } from '../../test/support/redis-server.js';
import { createScratchDatabase } from '../../test/support/scratch-database.js';

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
  /**
   * Opens another postgres.js client on the same database (`connection`:
   * server settings for its sessions; `countQueries`: count what it sends,
   * see {@link queriesSent}).
   */
  client(max: number, connection?: Record<string, string>, options?: { countQueries?: boolean }): postgres.Sql;
  /** Ends every client {@link client} opened (not `sql`): a section's, once it is done, so that later sections find free connections. */
  endClients(): Promise<void>;
  close(): Promise<void>;
}

/** Creates `palisade_bench_<random>` on `DATABASE_URL`; `close()` drops it (with force). */
export async function benchDatabase(max = 20): Promise<BenchDatabase> {
  const base = process.env.DATABASE_URL ?? DEFAULT_DATABASE_URL;
  assertLoopback(base, 'DATABASE_URL');
  const { name, url, drop } = await createScratchDatabase(base, 'palisade_bench');
  const clients: postgres.Sql[] = [];
  const client = (n: number, connection?: Record<string, string>, options?: { countQueries?: boolean }) => {
    const c = postgres(url, { max: n, onnotice: () => {}, ...(connection ? { connection } : {}) });
    if (options?.countQueries) {
      // postgres.js calls `options.debug` for every query its connections send. Given at creation it
      // also makes every query capture a stack trace (tens of µs of client CPU, more the deeper the
      // caller's stack: it slowed a repository write far more than a raw query); set afterwards, only
      // the count is paid — except on sessions derived later (reserve, begin), which copy it.
      const counter = { n: 0 };
      c.options.debug = () => {
        counter.n++;
      };
      queryCounts.set(c, counter);
    }
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
    async endClients() {
      const ending = clients.filter((c) => c !== sql);
      clients.splice(0, clients.length, sql);
      await Promise.allSettled(ending.map((c) => c.end({ timeout: 5 })));
    },
    async close() {
      await Promise.allSettled(clients.map((c) => c.end({ timeout: 5 })));
      await drop();
    },
  };
}

const queryCounts = new WeakMap<postgres.Sql, { n: number }>();

/** Queries sent so far by a client made with {@link BenchDatabase.client} and `countQueries`. */
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
  let server: PrivateRedis | undefined;
  let url: string;
  let own = false;
  if (hasBinary('redis-server') && process.env.BENCH_SHARED_REDIS !== '1') {
    server = await startPrivateRedis();
    url = server.url;
    own = true;
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
      await server?.stop();
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

function assertLoopback(url: string, what: string): void {
  const host = new URL(url).hostname;
  if (!['127.0.0.1', 'localhost', '::1', '[::1]'].includes(host)) {
    throw new Error(`${what} must point at loopback for a benchmark (got ${host})`);
  }
}

/**
 * Lets the database settle before the next section, so a section does not
 * start beside an autovacuum worker or a checkpoint that the one before set
 * off (section 7 leaves a purge's dead rows and a churned lease table
 * behind; on 2 cores either would take a core). Section 9's 16-client ratios
 * fell 10–20% after section 7, which is why this was added; the run of
 * 2026-12-03 found nothing running at any section's start, so that drop has
 * another cause (bench/lib/findings.ts, section 9). Waits (at most `maxWaitMs`) until no autovacuum worker runs on the bench
 * database, then vacuums it and checkpoints. Returns how long it took, in
 * seconds, and whether the wait hit its bound.
 */
export async function settleDatabase(
  pg: BenchDatabase,
  maxWaitMs = 60_000,
): Promise<{ seconds: number; waitCut: boolean }> {
  const started = performance.now();
  let waitCut = true;
  while (performance.now() - started < maxWaitMs) {
    const [row] = await pg.sql<{ n: number }[]>`
      select count(*)::int as n from pg_stat_activity
      where backend_type = 'autovacuum worker' and datname = current_database()`;
    if ((row?.n ?? 0) === 0) {
      waitCut = false;
      break;
    }
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
  await pg.sql.unsafe('vacuum (analyze)');
  await pg.sql.unsafe('checkpoint');
  return { seconds: (performance.now() - started) / 1000, waitCut };
}
