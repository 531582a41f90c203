/**
 * A bounded chaos run per backend (scripts/chaos.ts): 4 worker processes,
 * ~12 s of real faults (SIGSTOP past the TTL, kill -9, Redis FLUSHDB and
 * restart, pg_terminate_backend), then the history checker. Each must find
 * no anomalies AND show that the faults bit: at least one stale write was
 * rejected by the database. The long run for the README is
 * `npm run chaos` (docs/chaos-report.md).
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
import { type ChaosBackend, type ChaosOptions, runChaos } from '../../scripts/chaos.js';
import { needs } from '../support/services.js';

const SECONDS = Number(process.env.PALISADE_CHAOS_SECONDS ?? 12);
const REPLICATION_SECONDS = Number(process.env.PALISADE_CHAOS_REPLICATION_SECONDS ?? 25);

async function bounded(backend: ChaosBackend, extra: Partial<ChaosOptions> = {}) {
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
  // Kept on failure (the history is the evidence); removed after a passing run.
  rmSync(result.outDir, { recursive: true, force: true });
  return result;
}

const timeout = (SECONDS + 150) * 1000;

describe.runIf(needs('DATABASE_URL'))('chaos: postgres lease backend', () => {
  it(`${SECONDS} s of faults: no anomalies, stale writes rejected`, () => bounded('postgres'), timeout);
});

describe.runIf(needs('DATABASE_URL'))('chaos: postgres advisory backend', () => {
  it(`${SECONDS} s of faults: no anomalies, stale writes rejected`, () => bounded('advisory'), timeout);
});

// REDIS_URL's server is not used (the run FLUSHDBs and restarts a redis-server of its own); it marks where Redis runs.
describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL') && needs('REDIS_SERVER'))(
  'chaos: redis backend (a private redis-server)',
  () => {
    it(`${SECONDS} s of faults: no anomalies, stale writes rejected`, () => bounded('redis'), timeout);
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
