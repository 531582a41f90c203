/**
 * Section 2 — acquire + release, uncontended: serial (one name) and 16
 * clients on 16 distinct names. palisade Redis vs each Redis peer, plus
 * palisade's Postgres lease and advisory managers. Then a counting pass:
 * Redis commands per acquire and per release (client commands from MONITOR,
 * all executed commands from INFO commandstats), and Postgres transactions
 * per acquire/release (pg_stat_database.xact_commit).
 */
import type { BenchContext } from '../lib/context.js';
import { type LockUnderTest, palisadeAdvisory, palisadePostgres, redisLocks } from '../lib/locks.js';
import { type Case, compare, type Measured } from '../lib/measure.js';
import { countCommands, perOp } from '../lib/redis-count.js';
import { ms, ops, printTable, ratio } from '../lib/report.js';

const WAIT_MS = 2_000;
const COUNT_CYCLES = 200;

/** A pool of `n` names: each in-flight call takes one and gives it back, so no two calls share a name. */
export function namePool(prefix: string, n: number): { take(): string; give(name: string): void } {
  const free = Array.from({ length: n }, (_, i) => `${prefix}-${i}`);
  return {
    take() {
      const name = free.pop();
      if (name === undefined) throw new Error('name pool exhausted: more calls in flight than names');
      return name;
    },
    give(name) {
      free.push(name);
    },
  };
}

export function roundTripCase(lock: LockUnderTest, prefix: string, names: number): Case {
  const pool = namePool(`${prefix}-${lock.label.replace(/\W+/g, '')}`, names);
  return {
    name: lock.label,
    fn: async () => {
      const name = pool.take();
      try {
        const held = await lock.acquire(name, WAIT_MS);
        await held.release();
      } finally {
        pool.give(name);
      }
    },
  };
}

/** All locks of sections 2–5: the Redis ones (palisade first) and palisade's Postgres ones. */
export async function allLocks(ctx: BenchContext): Promise<LockUnderTest[]> {
  const locks = await redisLocks(ctx);
  locks.push(palisadePostgres(ctx));
  const advisory = await palisadeAdvisory(ctx);
  if (advisory) locks.push(advisory);
  else ctx.report.note('palisade advisory manager not found in src/fencing/advisory.ts: not measured');
  return locks;
}

export async function lockRoundTrips(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const locks = await allLocks(ctx);
  try {
    const redisPeers = locks.filter((l) => l.store === 'redis' && !l.label.startsWith('palisade'));
    const results: Record<string, Measured[]> = {};
    for (const concurrency of [1, 16]) {
      const label = concurrency === 1 ? 'serial, one name' : `${concurrency} clients, distinct names`;
      const cases = locks.map((l) => roundTripCase(l, `rt${concurrency}`, concurrency));
      const m = await compare(cases, { concurrency, rounds: scale.rounds, timeMs: scale.timeMs });
      results[label] = m;
      const peerResults = m.filter((r) => redisPeers.some((p) => p.label === r.name));
      const best = peerResults.reduce((a, b) => (b.opsPerSec > a.opsPerSec ? b : a));
      const t = report.table('2. Lock round trips (acquire + release, uncontended)', label, [
        'lock',
        'cycles/s',
        'p50 ms',
        'p99 ms',
        `× best Redis peer (${best.name})`,
      ]);
      for (const r of m)
        t.rows.push([r.name, ops(r.opsPerSec), ms(r.p50Ms), ms(r.p99Ms), ratio(r.opsPerSec / best.opsPerSec)]);
      printTable(t);
      const ours = m.find((r) => r.name === 'palisade Redis') as Measured;
      report.goal({
        section: '2',
        goal: `palisade Redis ≥ 1.0× the fastest Redis peer (${label})`,
        measured: `${ratio(ours.opsPerSec / best.opsPerSec)} of ${best.name}`,
        met: ours.opsPerSec >= best.opsPerSec,
      });
    }
    report.raw.lockRoundTrips = results;
    await countRedis(
      ctx,
      locks.filter((l) => l.store === 'redis'),
    );
    await countPostgres(
      ctx,
      locks.filter((l) => l.store === 'postgres'),
    );
  } finally {
    for (const l of locks) await l.close();
  }
}

async function countRedis(ctx: BenchContext, locks: LockUnderTest[]): Promise<void> {
  const { report } = ctx;
  const t = report.table('2. Lock round trips (acquire + release, uncontended)', 'Redis commands per operation', [
    'lock',
    'acquire: sent',
    'release: sent',
    'acquire: executed (commandstats)',
    'release: executed (commandstats)',
    'acquire: by command',
    'release: by command',
  ]);
  if (!ctx.redis.own) t.notes.push('counts taken on a shared Redis: other clients inflate them');
  for (const lock of locks) {
    // Warm up (script loading, subscriber connections) before counting.
    for (let i = 0; i < 5; i++) await (await lock.acquire(`count-warm-${i}`, WAIT_MS)).release();
    const held: { release(): Promise<unknown> }[] = [];
    const acq = await countCommands(ctx.redis, async () => {
      for (let i = 0; i < COUNT_CYCLES; i++) held.push(await lock.acquire(`count-${i}`, WAIT_MS));
    });
    const rel = await countCommands(ctx.redis, async () => {
      for (const h of held) await h.release();
    });
    const n = COUNT_CYCLES;
    t.rows.push([
      lock.label,
      (acq.clientCommands / n).toFixed(2),
      (rel.clientCommands / n).toFixed(2),
      (acq.executedTotal / n).toFixed(2),
      (rel.executedTotal / n).toFixed(2),
      perOp(acq.executed, n),
      perOp(rel.executed, n),
    ]);
    if (lock.label === 'palisade Redis') {
      const a = acq.clientCommands / n;
      const r = rel.clientCommands / n;
      report.goal({
        section: '2',
        goal: 'exactly one Redis command per acquire and one per release (palisade Redis)',
        measured: `${a.toFixed(2)} per acquire, ${r.toFixed(2)} per release (client commands); ${(acq.executedTotal / n).toFixed(1)} / ${(rel.executedTotal / n).toFixed(1)} executed incl. inside the scripts`,
        met: a === 1 && r === 1,
      });
      report.raw.palisadeRedisCommands = {
        acquire: Object.fromEntries(acq.executed),
        release: Object.fromEntries(rel.executed),
      };
    }
  }
  t.notes.push(
    '"sent" = commands that arrived from a client (MONITOR, script-internal ones excluded) = round trips; "executed" = INFO commandstats delta, which also counts every redis.call inside a script.',
  );
  printTable(t);
}

async function countPostgres(ctx: BenchContext, locks: LockUnderTest[]): Promise<void> {
  const { report } = ctx;
  if (locks.length === 0) return;
  const t = report.table(
    '2. Lock round trips (acquire + release, uncontended)',
    'Postgres transactions per operation',
    ['lock', 'acquire', 'release'],
  );
  const commits = async () => {
    // Backends flush their statistics at most once a second when idle.
    await new Promise((r) => setTimeout(r, 1_100));
    const [row] = await ctx.pg
      .sql`select xact_commit::int8::text as c from pg_stat_database where datname = current_database()`;
    return Number(row?.c);
  };
  // Advisory leases hold a connection each: hold at most 10 at a time.
  const n = 10;
  const rounds = 10;
  for (const lock of locks) {
    for (let i = 0; i < 5; i++) await (await lock.acquire(`count-warm-${i}`, WAIT_MS)).release();
    let acquire = 0;
    let release = 0;
    for (let r = 0; r < rounds; r++) {
      const held: { release(): Promise<unknown> }[] = [];
      const c0 = await commits();
      for (let i = 0; i < n; i++) held.push(await lock.acquire(`count-${i}`, WAIT_MS));
      const c1 = await commits();
      for (const h of held) await h.release();
      const c2 = await commits();
      // Each `commits()` read is one transaction of its own.
      acquire += c1 - c0 - 1;
      release += c2 - c1 - 1;
      if (r === 1) break; // two rounds are enough: the counts are exact, the waits are slow
    }
    t.rows.push([lock.label, (acquire / (2 * n)).toFixed(2), (release / (2 * n)).toFixed(2)]);
  }
  t.notes.push(
    "From pg_stat_database.xact_commit deltas on the run's own database: an autocommit statement is one transaction.",
  );
  printTable(t);
}
