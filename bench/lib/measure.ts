/**
 * Side-by-side timing: every case of a comparison runs in each round, in a
 * rotated order, for a short block of time (tens of ms), over many rounds.
 * This machine's speed drifts by tens of percent from one second to the
 * next (a shared host): two runs of the same case 400 ms apart differed by
 * up to ±50%, while adjacent 50 ms blocks differ little, so short blocks
 * paired round by round (see {@link pairedRatio}) are what makes a
 * difference of a few percent measurable at all.
 *
 * Each block is a closed loop of `concurrency` calls in flight (1 =
 * serial): throughput is calls over the block's wall time; latency is
 * per call; CPU is this process's user + system time over the block.
 */
import { performance } from 'node:perf_hooks';

/** One thing to time. `fn` must be bounded (it runs thousands of times). */
export interface Case {
  readonly name: string;
  readonly fn: () => Promise<unknown>;
  /** Runs once before each block of this case (untimed), e.g. to reset a row. */
  readonly before?: () => Promise<void>;
}

export interface MeasureOptions {
  /** Calls in flight: 1 = serial. */
  readonly concurrency: number;
  readonly rounds: number;
  /** Time per case per round (ms): one block. */
  readonly timeMs: number;
  /**
   * The collection between rounds (with `--expose-gc`), so that no case
   * pays for the young garbage of another: `minor` (the default) empties
   * the young generation; `full` is a full mark-compact, which also makes
   * V8 throw away optimized code that embedded objects that died ("weak
   * objects" deoptimizations: ~300 per 60 rounds of two write cases),
   * so every case is compiled again each round — a cost a process that
   * collects fully every few hundred ms would pay, no user's (a diagnostic).
   */
  readonly collection?: 'minor' | 'full';
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

/** The untimed warm-up of each case: pooled connections, scripts, prepared statements, the JIT. */
const WARMUP_MS = 250;

/**
 * Runs every case `rounds` times (rotating the order) and returns medians.
 * Throws the first error a case raises: a benchmark that fails must not
 * report a number.
 */
export async function compare(cases: readonly Case[], opts: MeasureOptions): Promise<Measured[]> {
  const perCase = cases.map(() => ({ ops: [] as number[], latencies: [] as number[], cpuUs: 0, calls: 0 }));
  for (const c of cases) {
    await c.before?.();
    await block(c, opts.concurrency, WARMUP_MS, undefined);
  }
  for (let round = 0; round < opts.rounds; round++) {
    // The young garbage of the last round is collected between rounds, not on a case's time
    // (`npm run bench` runs node with --expose-gc).
    (globalThis as { gc?: (o?: { type: 'minor' }) => void }).gc?.(
      opts.collection === 'full' ? undefined : { type: 'minor' },
    );
    for (let k = 0; k < cases.length; k++) {
      const i = (k + round) % cases.length;
      const c = cases[i] as Case;
      await c.before?.();
      const acc = perCase[i] as (typeof perCase)[number];
      const r = await block(c, opts.concurrency, opts.timeMs, acc.latencies);
      acc.ops.push(r.opsPerSec);
      acc.cpuUs += r.cpuUs;
      acc.calls += r.calls;
    }
  }
  return cases.map((c, i) => {
    const acc = perCase[i] as (typeof perCase)[number];
    const sorted = acc.latencies.sort((a, b) => a - b);
    return {
      name: c.name,
      opsPerSec: median(acc.ops),
      p50Ms: quantileSorted(sorted, 0.5),
      p99Ms: quantileSorted(sorted, 0.99),
      roundsOpsPerSec: acc.ops.map((x) => Math.round(x)),
      calls: acc.calls,
      cpuUsPerCall: acc.cpuUs / Math.max(1, acc.calls),
    };
  });
}

/** One block: `concurrency` workers call `c.fn` until `ms` have passed; latencies go to `latencies`. */
async function block(
  c: Case,
  concurrency: number,
  ms: number,
  latencies: number[] | undefined,
): Promise<{ opsPerSec: number; calls: number; cpuUs: number }> {
  let calls = 0;
  const cpu0 = process.cpuUsage();
  const started = performance.now();
  const stop = started + ms;
  await Promise.all(
    Array.from({ length: concurrency }, async () => {
      while (performance.now() < stop) {
        const t = performance.now();
        await c.fn();
        latencies?.push(performance.now() - t);
        calls++;
      }
    }),
  );
  const wallMs = performance.now() - started;
  const cpu = process.cpuUsage(cpu0);
  return { opsPerSec: (calls * 1000) / wallMs, calls, cpuUs: cpu.user + cpu.system };
}

/**
 * `a` over `b`, round by round (round i of one ran beside round i of the
 * other: same minutes of the machine's load), as the median of those
 * ratios with their min and max. What a goal between two cases is decided by.
 */
export function pairedRatio(a: Measured, b: Measured): { median: number; min: number; max: number } {
  const ratios = a.roundsOpsPerSec.map((v, i) => v / (b.roundsOpsPerSec[i] ?? Number.NaN));
  return { median: median(ratios), min: Math.min(...ratios), max: Math.max(...ratios) };
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
  return quantileSorted(
    [...xs].sort((a, b) => a - b),
    q,
  );
}

function quantileSorted(s: readonly number[], q: number): number {
  if (s.length === 0) return Number.NaN;
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil(q * s.length) - 1))] as number;
}

/**
 * A closed loop of `workers` async workers for `durationMs` (and at most
 * `maxIterations` per worker): for the cases `compare` cannot shape, such
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
