import type { Report } from './report.js';
import type { BenchDatabase, BenchRedis } from './services.js';

/**
 * How long and how big. `full` is what `npm run bench` runs and what the
 * results file reports; `quick` (`npm run bench -- --quick`) is for
 * developing the benchmark itself and its numbers mean little.
 */
export interface Scale {
  readonly name: 'full' | 'quick';
  /** Rounds per comparison (cases rotate between rounds). */
  readonly rounds: number;
  /** Time per case per round, ms. */
  readonly timeMs: number;
  /** Handoff / contention runs: duration per lock per round, ms. */
  readonly handoffMs: number;
  readonly handoffRounds: number;
  /** Memory section: acquire/release cycles. */
  readonly memoryCycles: number;
  /** Growth: rows of the large table. */
  readonly largeRows: number;
  /** Growth: live lock names of the "many" case. */
  readonly manyLocks: number;
  /** Growth: lease-table churn, acquire/release cycles, and the time cap for them (ms). */
  readonly churnCycles: number;
  readonly churnMaxMs: number;
  /** Growth: tombstones to purge, and the batch size. */
  readonly tombstones: number;
  readonly purgeBatch: number;
}

export const SCALES: Record<'full' | 'quick', Scale> = {
  full: {
    name: 'full',
    // Many short rounds rather than a few long ones: this machine's speed drifts within a second,
    // and only blocks of tens of ms, paired round by round, see the same machine (./measure.ts).
    rounds: 60,
    timeMs: 60,
    handoffMs: 4_000,
    handoffRounds: 3,
    memoryCycles: 100_000,
    largeRows: 1_000_000,
    manyLocks: 100_000,
    churnCycles: 1_000_000,
    churnMaxMs: 90_000,
    tombstones: 1_000_000,
    purgeBatch: 5_000,
  },
  quick: {
    name: 'quick',
    rounds: 6,
    timeMs: 40,
    handoffMs: 800,
    handoffRounds: 1,
    memoryCycles: 3_000,
    largeRows: 100_000,
    manyLocks: 5_000,
    churnCycles: 5_000,
    churnMaxMs: 5_000,
    tombstones: 50_000,
    purgeBatch: 5_000,
  },
};

/** Everything a section gets. */
export interface BenchContext {
  readonly scale: Scale;
  readonly pg: BenchDatabase;
  readonly redis: BenchRedis;
  readonly report: Report;
  /** Path of a syncguard build (`SYNCGUARD_PATH`), if given. */
  readonly syncguardPath: string | undefined;
  /** `--redis-locks`: sections 2 and 3 compare the Redis locks only (palisade Redis and the Redis peers). */
  readonly redisLocksOnly?: boolean;
}
