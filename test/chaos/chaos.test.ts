/**
 * A bounded chaos run per backend (scripts/chaos.ts): 4 worker processes,
 * ~12 s of real faults (SIGSTOP past the TTL, kill -9, Redis FLUSHDB and
 * restart, pg_terminate_backend, network partitions), then the history
 * checker. Each must find no anomalies AND show that the faults bit: at
 * least one stale write was rejected by the database, and at least one
 * partition cut off the lock holder — its write, sent while its process ran
 * on, was answered only after the partition healed. No worker may die on its
 * own: a lock-manager call or write that fails on a frozen connection is a
 * failed operation in the history, not a crash. The long run for the README
 * is `npm run chaos` (docs/chaos-report.md).
 *
 * Each run creates its own database on DATABASE_URL and, for Redis, starts
 * its own redis-server on a free loopback port (REDIS_URL's server is not
 * touched; it gates the suite so that a machine without Redis skips it).
 *
 * The replication nemesis (a private primary and replica: failovers,
 * failbacks with a split brain, resyncs, restarts, FLUSHALL) runs over 20
 * namespaces at once, so every reset is a recovery storm; it must also make
 * its minimum of failbacks and see grants on both sides of a split brain.
 */
import { rmSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { type ChaosBackend, type ChaosOptions, type ChaosResult, runChaos } from '../../scripts/chaos.js';
import { needs } from '../support/services.js';

const SECONDS = Number(process.env.PALISADE_CHAOS_SECONDS ?? 12);
const REPLICATION_SECONDS = Number(process.env.PALISADE_CHAOS_REPLICATION_SECONDS ?? 25);

/** A run, judged; `more` checks of its own come before its directory is removed (kept on failure). */
async function bounded(
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
function withPartitions(backend: ChaosBackend) {
  return bounded(backend, {}, (result, context) => {
    expect(result.faults.partition, context).toBeGreaterThan(0);
    expect(result.holderFaults.partition, `no partition caught the lock holder${context}`).toBeGreaterThan(0);
    expect(result.partitionedWrites, `no partition held up a holder's write${context}`).toBeGreaterThan(0);
  });
}

const timeout = (SECONDS + 150) * 1000;
const title = `${SECONDS} s of faults, partitions of the lock holder among them: no anomalies, stale writes rejected`;

describe.runIf(needs('DATABASE_URL'))('chaos: postgres lease backend', () => {
  it(title, () => withPartitions('postgres'), timeout);
});

describe.runIf(needs('DATABASE_URL'))('chaos: postgres advisory backend', () => {
  it(title, () => withPartitions('advisory'), timeout);
});

// REDIS_URL's server is not used (the run FLUSHDBs and restarts a redis-server of its own); it marks where Redis runs.
describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL') && needs('REDIS_SERVER'))(
  'chaos: redis backend (a private redis-server)',
  () => {
    it(title, () => withPartitions('redis'), timeout);
  },
);

describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL') && needs('REDIS_SERVER'))(
  'chaos: redis replication nemesis (a private primary and replica), 20 namespaces',
  () => {
    it(
      `${REPLICATION_SECONDS} s of failovers, failbacks, split brains, resyncs, restarts, flushes: no anomalies`,
      async () => {
        const result = await bounded('redis', {
          nemesis: 'replication',
          namespaces: 20,
          minFailbacks: 2,
          workers: 3,
          seconds: REPLICATION_SECONDS,
        });
        const context = `\n${result.text}`;
        expect(result.replication?.failbacks, context).toBeGreaterThanOrEqual(2);
        expect(result.replication?.grantsOnOldPrimary, context).toBeGreaterThan(0);
        expect(result.replication?.grantsOnNewPrimary, context).toBeGreaterThan(0);
      },
      (REPLICATION_SECONDS + 150) * 1000,
    );
  },
);
