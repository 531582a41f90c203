/**
 * Side-by-side timing on tinybench: every case of a comparison runs in each
 * round, in a rotated order, so drift on a shared machine (other engineers'
 * tests, autovacuum, CPU frequency) spreads over all cases instead of
 * favouring whichever ran first. Ratios are taken between medians of the
 * same run.
 *
 * - Serial: one call at a time; tinybench's latency samples give p50/p99.
 * - Concurrent: tinybench's `concurrency: 'task'` keeps `concurrency`
 *   calls in flight (a closed loop of that many clients); throughput is
 *   iterations over the wall time of the round, latency per call.
 */
import { performance } from 'node:perf_hooks';
import { Bench } from 'tinybench';

/** One thing to time. `fn` must be bounded (it runs thousands of times). */
export interface Case {
  readonly name: string;
  readonly fn: () => Promise<unknown>;
  /** Runs once before each round of this case (untimed), e.g. to reset a row. */
  readonly before?: () => Promise<void>;
}

export interface MeasureOptions {
  /** Calls in flight: 1 = serial. */
  readonly concurrency: number;
  readonly rounds: number;
  /** Time per case per round (ms). */
  readonly timeMs: number;
  readonly warmupMs?: number;
}

/** Medians over rounds. Latencies in ms. */
export interface Measured {
  readonly name: string;
  readonly opsPerSec: number;
  readonly p50Ms: number;
  readonly p99Ms: number;
  /** ops/s of each round, for the JSON file. */
  readonly roundsOpsPerSec: readonly number[];
  readonly calls: number;
  /** This process's CPU time per call (µs, user + system): the client-side cost, whatever the machine's load. */
  readonly cpuUsPerCall: number;
}

/**
 * Runs every case `rounds` times (rotating the order) and returns medians.
 * Throws the first error a case raises: a benchmark that fails must not
 * report a number.
 */
export async function compare(cases: readonly Case[], opts: MeasureOptions): Promise<Measured[]> {
  const perCase = cases.map(() => ({
    ops: [] as number[],
    p50: [] as number[],
    p99: [] as number[],
    cpu: [] as number[],
    calls: 0,
  }));
  // An untimed pass first: opens pooled connections, loads scripts, prepares statements, warms the JIT,
  // so that none of it lands on whichever case happens to run first.
  for (const c of cases) {
    await c.before?.();
    await timeOne(c, { ...opts, timeMs: Math.min(250, opts.timeMs / 2), warmupMs: 0 });
  }
  for (let round = 0; round < opts.rounds; round++) {
    for (let k = 0; k < cases.length; k++) {
      const i = (k + round) % cases.length;
      const c = cases[i] as Case;
      await c.before?.();
      const r = await timeOne(c, opts);
      const acc = perCase[i] as (typeof perCase)[number];
      acc.ops.push(r.opsPerSec);
      acc.p50.push(r.p50Ms);
      acc.p99.push(r.p99Ms);
      acc.cpu.push(r.cpuUsPerCall);
      acc.calls += r.calls;
    }
  }
  return cases.map((c, i) => {
    const acc = perCase[i] as (typeof perCase)[number];
    return {
      name: c.name,
      opsPerSec: median(acc.ops),
      p50Ms: median(acc.p50),
      p99Ms: median(acc.p99),
      roundsOpsPerSec: acc.ops.map((x) => Math.round(x)),
      calls: acc.calls,
      cpuUsPerCall: median(acc.cpu),
    };
  });
}

async function timeOne(
  c: Case,
  opts: MeasureOptions,
): Promise<{ opsPerSec: number; p50Ms: number; p99Ms: number; calls: number; cpuUsPerCall: number }> {
  const concurrent = opts.concurrency > 1;
  const bench = new Bench({
    time: opts.timeMs,
    // warmupMs 0 = no warm-up (a concurrent warm-up needs a positive time bound, or it never ends).
    warmup: opts.warmupMs !== 0,
    warmupTime: opts.warmupMs || Math.min(200, opts.timeMs / 4),
    // Serial: a minimum; concurrent: 0 = no cap, time bounds it (threshold must then be finite).
    iterations: concurrent ? 0 : 8,
    warmupIterations: concurrent ? 0 : 4,
    concurrency: concurrent ? 'task' : null,
    threshold: concurrent ? opts.concurrency : Number.POSITIVE_INFINITY,
    throws: true,
    // A bound on the whole case, whatever happens to the loop inside tinybench.
    signal: AbortSignal.timeout(Math.max(30_000, opts.timeMs * 20)),
  });
  let started = 0;
  let ended = 0;
  let cpu0 = process.cpuUsage();
  let cpu = { user: 0, system: 0 };
  bench.add(c.name, c.fn, {
    beforeAll(mode) {
      if (mode !== 'run') return;
      started = performance.now();
      cpu0 = process.cpuUsage();
    },
    afterAll(mode) {
      if (mode !== 'run') return;
      ended = performance.now();
      cpu = process.cpuUsage(cpu0);
    },
  });
  await bench.run();
  const result = bench.tasks[0]?.result;
  if (!result || !('latency' in result)) {
    const error = result && 'error' in result ? result.error : undefined;
    throw new Error(`benchmark case ${c.name} did not complete (${result?.state ?? 'no result'})`, { cause: error });
  }
  const calls = result.latency.samplesCount;
  const wallMs = ended - started;
  return {
    opsPerSec: concurrent ? (calls * 1000) / wallMs : 1000 / result.latency.mean,
    p50Ms: result.latency.p50,
    p99Ms: result.latency.p99,
    calls,
    cpuUsPerCall: (cpu.user + cpu.system) / Math.max(1, calls),
  };
}

/** The median of `xs` (mean of the middle two for an even count); NaN when empty. */
export function median(xs: readonly number[]): number {
  if (xs.length === 0) return Number.NaN;
  const s = [...xs].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? (s[mid] as number) : ((s[mid - 1] as number) + (s[mid] as number)) / 2;
}

/** The q-quantile (0…1) of `xs`, nearest rank. */
export function quantile(xs: readonly number[], q: number): number {
  if (xs.length === 0) return Number.NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil(q * s.length) - 1))] as number;
}

/**
 * A closed loop of `workers` async workers for `durationMs` (and at most
 * `maxIterations` per worker): for the cases tinybench cannot shape, such
 * as several workers contending for one lock.
 */
export async function closedLoop(
  workers: number,
  durationMs: number,
  maxIterations: number,
  body: (worker: number, iteration: number) => Promise<void>,
): Promise<{ wallMs: number; iterations: number[] }> {
  const start = performance.now();
  const deadline = start + durationMs;
  const iterations = new Array<number>(workers).fill(0);
  await Promise.all(
    Array.from({ length: workers }, async (_, w) => {
      for (let i = 0; i < maxIterations && performance.now() < deadline; i++) {
        await body(w, i);
        iterations[w] = i + 1;
      }
    }),
  );
  return { wallMs: performance.now() - start, iterations };
}
