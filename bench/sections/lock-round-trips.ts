/**
 * Section 2 — acquire + release, uncontended: serial (one name) and 16
 * clients on 16 distinct names. palisade Redis vs each Redis peer, plus
 * palisade's Postgres lease and advisory managers. Then a counting pass:
 * Redis commands per acquire and per release (client commands from MONITOR,
 * all executed commands from INFO commandstats), and Postgres transactions
 * per acquire/release (pg_stat_database.xact_commit).
 */
import type { BenchContext } from '../lib/context.js';
import { type LockUnderTest, palisadeAdvisory, palisadePostgres, redisLocks, redisSemaphore } from '../lib/locks.js';
import { type Case, compare, type Measured, pairedRatio } from '../lib/measure.js';
import { countCommands, perOp, serverMicros } from '../lib/redis-count.js';
import { comparedCells, printTable, ratio } from '../lib/report.js';

const WAIT_MS = 2_000;
const SEMAPHORE = 'redis-semaphore Mutex';
const CONTROL = 'redis-semaphore Mutex, again (A/A control)';
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
  if (ctx.redisLocksOnly) return locks;
  locks.push(palisadePostgres(ctx));
  const advisory = await palisadeAdvisory(ctx);
  if (advisory) locks.push(advisory);
  return locks;
}

export async function lockRoundTrips(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const locks = await allLocks(ctx);
  // redis-semaphore once more, on a connection of its own: how far noise alone moves a ratio.
  const control: LockUnderTest = { ...redisSemaphore(ctx), label: CONTROL };
  try {
    const redisPeers = locks.filter((l) => l.store === 'redis' && !l.label.startsWith('palisade'));
    const results: Record<string, Measured[]> = {};
    for (const concurrency of [1, 16]) {
      const label = concurrency === 1 ? 'serial, one name' : `${concurrency} clients, distinct names`;
      const cases = [...locks, control].map((l) => roundTripCase(l, `rt${concurrency}`, concurrency));
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
        '× best, min–max of rounds',
        'client CPU µs/cycle',
      ]);
      for (const r of m) t.rows.push([...comparedCells(r, best), r.cpuUsPerCall.toFixed(0)]);
      const aa = pairedRatio(
        m.find((r) => r.name === CONTROL) as Measured,
        m.find((r) => r.name === SEMAPHORE) as Measured,
      );
      t.notes.push(
        'Ratios are medians of per-round ratios (round i of one lock ran beside round i of the other).',
        `A/A control: redis-semaphore Mutex measured twice came out at ${ratio(aa.median)} of itself (rounds ${ratio(aa.min)}–${ratio(aa.max)}); a ratio closer to a goal than that is within noise.`,
      );
      printTable(t);
      const ours = pairedRatio(m.find((r) => r.name === 'palisade Redis') as Measured, best).median;
      report.goal({
        section: '2',
        goal: `palisade Redis ≥ 1.0× the fastest Redis peer (${label})`,
        measured: `${ratio(ours)} of ${best.name}`,
        met: ours >= 1,
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
    for (const l of [...locks, control]) await l.close();
  }
}

async function countRedis(ctx: BenchContext, locks: LockUnderTest[]): Promise<void> {
  const { report } = ctx;
  const t = report.table('2. Lock round trips (acquire + release, uncontended)', 'Redis commands per operation', [
    'lock',
    'acquire: sent',
    'release: sent',
    'acquire: executed',
    'release: executed',
    'acquire: server µs',
    'release: server µs',
    'acquire: executed by command',
    'release: executed by command',
  ]);
  if (!ctx.redis.own) t.notes.push('counts taken on a shared Redis: other clients inflate them');
  const n = COUNT_CYCLES;
  for (const lock of locks) {
    // Warm up (script loading, subscriber connections) before counting.
    for (let i = 0; i < 5; i++) await (await lock.acquire(`count-warm-${i}`, WAIT_MS)).release();
    const pass = async (monitor: boolean) => {
      const held: { release(): Promise<unknown> }[] = [];
      const acquire = await countCommands(
        ctx.redis,
        async () => {
          for (let i = 0; i < n; i++) held.push(await lock.acquire(`count-${i}`, WAIT_MS));
        },
        { monitor },
      );
      const release = await countCommands(
        ctx.redis,
        async () => {
          for (const h of held) await h.release();
        },
        { monitor },
      );
      return { acquire, release };
    };
    const counted = await pass(true); // round trips, from MONITOR
    const timed = await pass(false); // executed commands and server time, without MONITOR's overhead
    t.rows.push([
      lock.label,
      (counted.acquire.sentTotal / n).toFixed(2),
      (counted.release.sentTotal / n).toFixed(2),
      (timed.acquire.executedTotal / n).toFixed(2),
      (timed.release.executedTotal / n).toFixed(2),
      (serverMicros(timed.acquire, counted.acquire.sent) / n).toFixed(1),
      (serverMicros(timed.release, counted.release.sent) / n).toFixed(1),
      perOp(timed.acquire.executed, n),
      perOp(timed.release.executed, n),
    ]);
    if (lock.label === 'palisade Redis') {
      const a = counted.acquire.sentTotal / n;
      const r = counted.release.sentTotal / n;
      report.goal({
        section: '2',
        goal: 'exactly one Redis command per acquire and one per release (palisade Redis)',
        measured: `${a.toFixed(2)} per acquire, ${r.toFixed(2)} per release (sent); ${(timed.acquire.executedTotal / n).toFixed(1)} / ${(timed.release.executedTotal / n).toFixed(1)} executed incl. inside the scripts`,
        met: a === 1 && r === 1,
      });
      report.raw.palisadeRedisCommands = {
        acquire: Object.fromEntries(timed.acquire.executed),
        release: Object.fromEntries(timed.release.executed),
      };
    }
  }
  t.notes.push(
    '"sent" = commands that arrived from a client (MONITOR; script-internal ones excluded) = round trips. "executed" = INFO commandstats delta, which also counts every redis.call inside a script. "server µs" = commandstats time of the sent commands, script bodies included, from a second pass without MONITOR.',
  );
  printTable(t);
}

async function countPostgres(ctx: BenchContext, locks: LockUnderTest[]): Promise<void> {
  const { report } = ctx;
  if (locks.length === 0) return;
  const t = report.table('2. Lock round trips (acquire + release, uncontended)', 'Postgres statements per operation', [
    'lock',
    'acquire',
    'release',
  ]);
  // Advisory leases hold a connection each: hold at most 10 at a time.
  const n = 10;
  const rounds = 5;
  for (const lock of locks) {
    for (let i = 0; i < 5; i++) await (await lock.acquire(`count-warm-${i}`, WAIT_MS)).release();
    let acquire = 0;
    let release = 0;
    for (let r = 0; r < rounds; r++) {
      const held: { release(): Promise<unknown> }[] = [];
      const q0 = lock.sent();
      for (let i = 0; i < n; i++) held.push(await lock.acquire(`count-${i}`, WAIT_MS));
      const q1 = lock.sent();
      for (const h of held) await h.release();
      acquire += q1 - q0;
      release += lock.sent() - q1;
    }
    t.rows.push([lock.label, (acquire / (rounds * n)).toFixed(2), (release / (rounds * n)).toFixed(2)]);
  }
  t.notes.push(
    "Queries the lock's postgres.js clients sent (counted client side; the advisory backend's sessions included).",
  );
  printTable(t);
}
