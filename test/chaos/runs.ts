/**
 * The bounded chaos runs of the test suites (scripts/chaos.ts): 4 worker
 * processes, ~12 s of real faults (SIGSTOP past the TTL, kill -9, Redis
 * FLUSHDB and restart, pg_terminate_backend, network partitions), then the
 * history checker. Each must find no anomalies AND show that the faults bit:
 * at least one stale write was rejected by the database, and, with
 * partitions, at least one cut off the lock holder — its write, sent while
 * its process ran on, was answered only after the partition healed. No
 * worker may die on its own: a lock-manager call or write that fails on a
 * frozen connection is a failed operation in the history, not a crash.
 *
 * Each run creates its own database on DATABASE_URL and, for Redis, starts
 * its own redis-server on a free loopback port (REDIS_URL's server is not
 * touched; it gates the suites so that a machine without Redis skips them).
 */
import { rmSync } from 'node:fs';
import { expect } from 'vitest';
import { type ChaosBackend, type ChaosOptions, type ChaosResult, runChaos } from '../../scripts/chaos.js';

export const SECONDS = Number(process.env.PALISADE_CHAOS_SECONDS ?? 12);

/** A run, judged; `more` checks of its own come before its directory is removed (kept on failure). */
export async function bounded(
  backend: ChaosBackend,
  extra: Partial<ChaosOptions> = {},
  more: (result: ChaosResult, context: string) => void = () => {},
) {
  const result = await runChaos({
    backend,
    workers: 4,
    seconds: SECONDS,
    ttlMs: 1000,
    databaseUrl: process.env.DATABASE_URL ?? '',
    ...extra,
  });
  // The whole report on failure: settings, faults, findings, the history's path and the command to reproduce.
  const context = `\n${result.text}`;
  expect(result.report.anomalies, context).toEqual([]);
  expect(result.report.staleWrites.accepted, context).toBe(0);
  expect(result.report.staleWrites.rejected, `the faults did not bite${context}`).toBeGreaterThan(0);
  expect(result.report.overlappingHolds, context).toBeGreaterThan(0);
  expect(result.ok, context).toBe(true);
  // A worker that died on its own is no safety anomaly, but a bug all the same (the driver's crash on a
  // transaction whose connection the server closed was one: test/repo/lost-connection.test.ts).
  expect(result.crashes, `a worker died on its own${context}`).toEqual([]);
  more(result, context);
  // Kept on failure (the history is the evidence); removed after a passing run.
  rmSync(result.outDir, { recursive: true, force: true });
  return result;
}

/** The standard nemesis: besides {@link bounded}'s checks, a partition that held up a holder's write. */
export function withPartitions(backend: ChaosBackend, extra: Partial<ChaosOptions> = {}) {
  return bounded(backend, extra, (result, context) => {
    // `?? 0`: a count that never started is absent, and a matcher given undefined drops the context.
    expect(result.faults.partition ?? 0, context).toBeGreaterThan(0);
    expect(result.holderFaults.partition ?? 0, `no partition caught the lock holder${context}`).toBeGreaterThan(0);
    expect(result.partitionedWrites, `no partition held up a holder's write${context}`).toBeGreaterThan(0);
  });
}

/** A run's bound, for the test's timeout: its seconds plus setup, teardown and the checker. */
export const timeout = (seconds: number) => (seconds + 150) * 1000;
export const title = `${SECONDS} s of faults, partitions of the lock holder among them: no anomalies, stale writes rejected`;
