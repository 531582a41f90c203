/**
 * Section 7 — how cost grows with the work:
 *
 * a. fenced `update` on a table of 10,000 vs 1,000,000 rows (interleaved);
 * b. acquire+release with 10 vs 100,000 other live lock names, Redis and
 *    Postgres lease (phases: few → many → few again, since the keyspace and
 *    the lease table are shared by every name);
 * c. the Postgres lease table after many acquire/release cycles vs fresh:
 *    dead tuples, HOT updates, sizes, autovacuum runs, and the cycle rate;
 * d. purging 1,000,000 tombstones in bounded batches while writers update
 *    live rows of the same table: writer throughput and p99 during the
 *    purge vs before it.
 */
import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { drizzle } from 'drizzle-orm/postgres-js';
import type { Database } from '../../src/driver.js';
import type { Fence } from '../../src/fencing/fence.js';
import { postgresLockBackend } from '../../src/fencing/postgres.js';
import { redisLockBackend } from '../../src/fencing/redis.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { BenchContext } from '../lib/context.js';
import { type LockUnderTest, palisadePostgres, palisadeRedis } from '../lib/locks.js';
import { type Case, closedLoop, compare, type Measured, median, quantile } from '../lib/measure.js';
import { ms, ops, printTable, ratio } from '../lib/report.js';
import { createAccounts, FenceCounter, makeAccounts, randomId } from '../lib/tables.js';

export async function growth(ctx: BenchContext): Promise<void> {
  await tableSize(ctx);
  await liveLocks(ctx);
  await leaseChurn(ctx);
  await tombstonePurge(ctx);
}

async function tableSize(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const small = 10_000;
  const large = scale.largeRows;
  await createAccounts(ctx.pg.sql, 'bench_small', small);
  await createAccounts(ctx.pg.sql, 'bench_large', large);
  const fences = new FenceCounter(2_000_000_000n);
  const repoCase = (rows: number, name: string): Case => {
    const repo = fencedRepository(ctx.pg.db, makeAccounts(name));
    return {
      name: `repository.update, ${rows.toLocaleString('en-US')} rows`,
      fn: async () => {
        const r = await repo.update({ id: randomId(rows) }, fences.next() as Fence, { balance: 1 });
        if (r.status !== 'applied' && r.status !== 'stale') throw new Error(r.status);
      },
    };
  };
  const t = report.table('7. Growth', 'a. fenced update: table size', [
    'case',
    'serial ops/s',
    'p99 ms',
    '16 concurrent ops/s',
    'p99 ms',
  ]);
  const cases = [repoCase(small, 'bench_small'), repoCase(large, 'bench_large')];
  const serial = await compare(cases, { concurrency: 1, rounds: scale.rounds, timeMs: scale.timeMs });
  const conc = await compare(cases, { concurrency: 16, rounds: scale.rounds, timeMs: scale.timeMs });
  for (let i = 0; i < 2; i++) {
    const s = serial[i] as Measured;
    const c = conc[i] as Measured;
    t.rows.push([s.name, ops(s.opsPerSec), ms(s.p99Ms), ops(c.opsPerSec), ms(c.p99Ms)]);
  }
  const rs = (serial[1] as Measured).opsPerSec / (serial[0] as Measured).opsPerSec;
  const rc = (conc[1] as Measured).opsPerSec / (conc[0] as Measured).opsPerSec;
  t.rows.push(['large / small', ratio(rs), null, ratio(rc), null]);
  printTable(t);
  report.goal({
    section: '7a',
    goal: `fenced update ${large.toLocaleString('en-US')} vs 10,000 rows ≥ 0.9×`,
    measured: `${ratio(rs)} serial, ${ratio(rc)} at 16`,
    met: rs >= 0.9 && rc >= 0.9,
  });
  await ctx.pg.sql.unsafe('drop table bench_large');
  report.raw.growthTable = { serial, concurrent: conc };
}

/** Acquire+release on 16 names, 16 clients: the rate (cycles/s) over `timeMs`, repeated `rounds` times. */
async function cycleRate(lock: LockUnderTest, prefix: string, rounds: number, timeMs: number): Promise<number[]> {
  const rates: number[] = [];
  for (let r = 0; r < rounds; r++) {
    const { wallMs, iterations } = await closedLoop(16, timeMs, 1_000_000, async (w) => {
      await (await lock.acquire(`${prefix}-${w}`, 2_000)).release();
    });
    rates.push((iterations.reduce((a, b) => a + b, 0) * 1000) / wallMs);
  }
  return rates;
}

async function liveLocks(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const many = scale.manyLocks;
  const t = report.table(
    '7. Growth',
    `b. acquire+release (16 clients) with 10 vs ${many.toLocaleString('en-US')} live lock names`,
    ['backend', 'few (before) cycles/s', 'many cycles/s', 'few (after) cycles/s', 'many / few'],
  );
  const phases = 3;
  const phaseMs = Math.max(300, scale.timeMs);
  // Redis: the other live names are real grants by palisade's backend (no lease objects, 10 min TTL).
  {
    const lock = palisadeRedis(ctx, 'growth');
    const filler = ctx.redis.client();
    const backend = redisLockBackend({
      redis: filler,
      namespace: `${ctx.redis.prefix}growth`.replaceAll(':', '.'),
      epochs: ctx.pg.db,
    });
    try {
      await cycleRate(lock, 'g', 1, 2 * phaseMs); // warm-up
      for (let i = 0; i < 10; i++) await backend.grant(`live-${i}`, `t${i}`, 600_000, null);
      const before = await cycleRate(lock, 'g', phases, phaseMs);
      let next = 10;
      await closedLoop(64, 300_000, many, async () => {
        const i = next++;
        if (i < many) await backend.grant(`live-${i}`, `t${i}`, 600_000, null);
      });
      const dbsize = await filler.dbsize();
      const during = await cycleRate(lock, 'g', phases, phaseMs);
      // Free them again (release script per name, pipelined by ioredis's auto-pipelining of concurrent calls).
      next = 10;
      await closedLoop(64, 300_000, many, async () => {
        const i = next++;
        if (i < many) await backend.release(`live-${i}`, `t${i}`);
      });
      const after = await cycleRate(lock, 'g', phases, phaseMs);
      const r = median(during) / ((median(before) + median(after)) / 2);
      t.rows.push(['palisade Redis', ops(median(before)), ops(median(during)), ops(median(after)), ratio(r)]);
      t.notes.push(
        `Redis: ${dbsize.toLocaleString('en-US')} keys while "many" (a lock key and a grant record per name).`,
      );
      report.goal({
        section: '7b',
        goal: `Redis acquire+release with ${many.toLocaleString('en-US')} vs 10 live names ≥ 0.9×`,
        measured: ratio(r),
        met: r >= 0.9,
      });
    } finally {
      await backend.close();
      filler.disconnect();
      await lock.close();
    }
  }
  // Postgres: the other live names are rows of palisade.leases, inserted in one statement.
  {
    const lock = palisadePostgres(ctx, 'growth');
    try {
      await cycleRate(lock, 'g', 1, 2 * phaseMs); // warm-up
      const sql = ctx.pg.sql;
      const before = await cycleRate(lock, 'g', phases, phaseMs);
      await sql`insert into palisade.leases (namespace, name, token, holder, fence, acquired_at, expires_at)
        select 'growth-live', 'live-' || g, md5(g::text), null, nextval('palisade.fence_seq'), now(), now() + interval '1 hour'
        from generate_series(1, ${many}) g`;
      await sql`analyze palisade.leases`;
      const during = await cycleRate(lock, 'g', phases, phaseMs);
      await sql`delete from palisade.leases where namespace = 'growth-live'`;
      await sql`vacuum analyze palisade.leases`;
      const after = await cycleRate(lock, 'g', phases, phaseMs);
      const r = median(during) / ((median(before) + median(after)) / 2);
      t.rows.push(['palisade Postgres lease', ops(median(before)), ops(median(during)), ops(median(after)), ratio(r)]);
      report.goal({
        section: '7b',
        goal: `Postgres lease acquire+release with ${many.toLocaleString('en-US')} vs 10 live names ≥ 0.9×`,
        measured: ratio(r),
        met: r >= 0.9,
      });
    } finally {
      await lock.close();
    }
  }
  t.notes.push(
    `Each phase: ${phases} × ${phaseMs} ms, median. "few (after)" is measured once the many names are gone again, to show drift.`,
  );
  printTable(t);
}

async function leaseStats(ctx: BenchContext) {
  const [row] = await ctx.pg.sql`
    select n_live_tup::int8::text as live, n_dead_tup::int8::text as dead, n_tup_upd::int8::text as upd,
           n_tup_hot_upd::int8::text as hot, autovacuum_count::int8::text as autovacuums,
           pg_relation_size('palisade.leases')::int8::text as heap,
           pg_indexes_size('palisade.leases')::int8::text as indexes
    from pg_stat_user_tables where relid = 'palisade.leases'::regclass`;
  return {
    live: Number(row?.live),
    dead: Number(row?.dead),
    updates: Number(row?.upd),
    hot: Number(row?.hot),
    autovacuums: Number(row?.autovacuums),
    heapKB: Number(row?.heap) / 1024,
    indexKB: Number(row?.indexes) / 1024,
  };
}

async function leaseChurn(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const t = report.table('7. Growth', 'c. the Postgres lease table after churn vs fresh', [
    'state',
    'cycles/s (16 clients)',
    'live rows',
    'dead rows',
    'HOT updates',
    'heap KB',
    'indexes KB',
    'autovacuum runs',
  ]);
  const sql = ctx.pg.sql;
  await sql`delete from palisade.leases`;
  await sql`vacuum full palisade.leases`;
  await new Promise((r) => setTimeout(r, 1_100)); // stats settle
  const lock = palisadePostgres(ctx, 'churn');
  // The churn itself runs with synchronous_commit off (its own client): the table ends in the same state, faster.
  const churnClient = ctx.pg.client(20, { synchronous_commit: 'off' });
  const churnDb = drizzle(churnClient) as unknown as Database;
  const churnBackend = postgresLockBackend({ db: churnDb, namespace: 'churn', listen: false });
  try {
    const fresh = await cycleRate(lock, 'c', scale.rounds, scale.timeMs);
    const s0 = await leaseStats(ctx);
    t.rows.push([
      'fresh',
      ops(median(fresh)),
      s0.live,
      s0.dead,
      s0.hot,
      s0.heapKB.toFixed(0),
      s0.indexKB.toFixed(0),
      s0.autovacuums,
    ]);
    const started = performance.now();
    const { iterations } = await closedLoop(16, scale.churnMaxMs, Math.ceil(scale.churnCycles / 16), async (w) => {
      const token = randomBytes(16).toString('hex');
      const name = `c-${w}`;
      if (!(await churnBackend.grant(name, token, 10_000, null))) throw new Error('churn grant refused');
      await churnBackend.release(name, token);
    });
    const churned = iterations.reduce((a, b) => a + b, 0);
    const churnSecs = (performance.now() - started) / 1000;
    await new Promise((r) => setTimeout(r, 1_100));
    const s1 = await leaseStats(ctx);
    const after = await cycleRate(lock, 'c', scale.rounds, scale.timeMs);
    t.rows.push([
      `after ${churned.toLocaleString('en-US')} cycles`,
      ops(median(after)),
      s1.live,
      s1.dead,
      s1.hot,
      s1.heapKB.toFixed(0),
      s1.indexKB.toFixed(0),
      s1.autovacuums,
    ]);
    const r = median(after) / median(fresh);
    t.rows.push(['after / fresh', ratio(r), null, null, null, null, null, null]);
    if (churned < scale.churnCycles) {
      t.notes.push(
        `Scaled down: ${churned.toLocaleString('en-US')} of ${scale.churnCycles.toLocaleString('en-US')} cycles fit in the ${scale.churnMaxMs / 1000} s cap (${ops(churned / churnSecs)} cycles/s with synchronous_commit off).`,
      );
    }
    t.notes.push(
      "Each grant and release UPDATEs the lock's row; expires_at is indexed, so no update is HOT and every cycle leaves two dead heap tuples and index entries until (auto)vacuum. Default autovacuum (scale factor 0.2, naptime 1 min) lets a small, hot lease table bloat; suggested for palisade.leases: autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0 (ALTER TABLE … SET (…)).",
    );
    printTable(t);
    report.goal({ section: '7c', goal: 'lease table after churn vs fresh ≥ 0.9×', measured: ratio(r), met: r >= 0.9 });
    report.raw.leaseChurn = { fresh, after, churned, before: s0, afterStats: s1 };
  } finally {
    await churnBackend.close();
    await lock.close();
  }
}

async function tombstonePurge(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const sql = ctx.pg.sql;
  const live = 10_000;
  const name = 'bench_tomb';
  await createAccounts(sql, name, live);
  await sql.unsafe(`insert into ${name} (id, balance, last_fence, deleted_at)
    select g, 0, 1, now() - interval '1 day' from generate_series(${live + 1}, ${live + scale.tombstones}) g`);
  await sql.unsafe(`vacuum analyze ${name}`);
  const table = makeAccounts(name);
  const repo = fencedRepository(ctx.pg.db, table);
  const fences = new FenceCounter(3_000_000_000n);
  const writers = 4;
  const write = async () => {
    const t0 = performance.now();
    const r = await repo.update({ id: randomId(live) }, fences.next() as Fence, { balance: 1 });
    if (r.status !== 'applied' && r.status !== 'stale') throw new Error(r.status);
    return performance.now() - t0;
  };
  // Writers alone.
  const baseLat: number[] = [];
  const base = await closedLoop(writers, Math.max(1_000, scale.timeMs * 2), 1_000_000, async () => {
    baseLat.push(await write());
  });
  // Writers while the purge runs.
  const purgeLat: number[] = [];
  const batches: number[] = [];
  let purged = 0;
  let purging = true;
  const olderThan = new Date(Date.now() - 3_600_000);
  const purgeStart = performance.now();
  const purger = (async () => {
    try {
      for (let i = 0; i < 100_000; i++) {
        const t0 = performance.now();
        const n = await repo.purgeTombstones(olderThan, { batchSize: scale.purgeBatch });
        batches.push(performance.now() - t0);
        purged += n;
        if (n === 0) break;
      }
    } finally {
      purging = false;
    }
  })();
  // Writers until the purge is done (bounded by the purge's own bounded loop).
  await Promise.all(
    Array.from({ length: writers }, async () => {
      while (purging) purgeLat.push(await write());
    }),
  );
  await purger;
  const purgeSecs = (performance.now() - purgeStart) / 1000;
  const baseRate = (baseLat.length * 1000) / base.wallMs;
  const duringRate = purgeLat.length / purgeSecs;
  const t = report.table(
    '7. Growth',
    `d. purging ${scale.tombstones.toLocaleString('en-US')} tombstones while ${writers} writers update live rows`,
    ['measure', 'value'],
  );
  const r = duringRate / baseRate;
  t.rows.push(
    ['tombstones purged', purged.toLocaleString('en-US')],
    ['batches (size)', `${batches.length} (${scale.purgeBatch})`],
    ['purge time', `${purgeSecs.toFixed(1)} s (${ops(purged / purgeSecs)} rows/s)`],
    ['batch duration p50 / max', `${ms(median(batches))} / ${ms(Math.max(...batches))} ms`],
    [
      'first 5 / last 5 batches, median',
      `${ms(median(batches.slice(0, 5)))} / ${ms(median(batches.slice(-6, -1)))} ms`,
    ],
    ['writer ops/s before / during', `${ops(baseRate)} / ${ops(duringRate)} (${ratio(r)})`],
    ['writer p99 before / during', `${ms(quantile(baseLat, 0.99))} / ${ms(quantile(purgeLat, 0.99))} ms`],
  );
  t.notes.push(
    "purgeTombstones deletes by ctid from a LIMITed scan: deleted_at has no index, so each batch scans from the start of the table past rows already deleted (dead until vacuum). Rows are never locked by the writers' keys, so writers are not blocked — they only share CPU and I/O.",
  );
  printTable(t);
  report.goal({
    section: '7d',
    goal: 'writers during the tombstone purge ≥ 0.9× before',
    measured: ratio(r),
    met: r >= 0.9,
  });
  report.raw.tombstonePurge = { purged, batches, baseRate, duringRate };
  await sql.unsafe(`drop table ${name}`);
}
