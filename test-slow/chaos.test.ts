/**
 * Bounded chaos runs on the Redis, Postgres lease, advisory and etcd backends
 * (checked as in test/chaos/runs.ts), and the replication nemesis: a private
 * primary and replica with failovers, failbacks with a split brain, resyncs,
 * restarts and FLUSHALL, over 20 namespaces at once, so every reset is a
 * recovery storm; it must also make its minimum of failbacks and see grants
 * on both sides of a split brain. (The Redis run was in `npm test` until the
 * suite outgrew its 6 minutes on this 2-core machine: four worker processes
 * and a Redis of their own took the CPU from every file running beside it.)
 */
import { describe, expect, it } from 'vitest';
import { bounded, SECONDS, timeout, title, withPartitions } from '../test/chaos/runs.js';
import { needs } from '../test/support/services.js';

const REPLICATION_SECONDS = Number(process.env.PALISADE_CHAOS_REPLICATION_SECONDS ?? 25);
// Twice the others' faults: a lease of 2 s makes each pause and partition twice as long.
const ETCD_SECONDS = 2 * SECONDS;

// REDIS_URL's server is not used (the run FLUSHDBs and restarts a redis-server of its own); it marks where Redis runs.
describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL') && needs('REDIS_SERVER'))(
  'chaos: redis backend (a private redis-server)',
  () => {
    it(title, () => withPartitions('redis'), timeout(SECONDS));
  },
);

describe.runIf(needs('DATABASE_URL'))('chaos: postgres lease backend', () => {
  it(title, () => withPartitions('postgres'), timeout(SECONDS));
});

describe.runIf(needs('DATABASE_URL'))('chaos: postgres advisory backend', () => {
  it(title, () => withPartitions('advisory'), timeout(SECONDS));
});

// A 3-member cluster of the run's own; etcd keeps leases of whole seconds, at least 2 s with its 1 s election timeout.
describe.runIf(needs('DATABASE_URL') && needs('ETCD'))(
  'chaos: etcd backend (a private 3-member cluster: members killed, the leader paused)',
  () => {
    it(
      `${ETCD_SECONDS} s of faults, partitions of the lock holder among them: no anomalies, stale writes rejected`,
      async () => {
        const result = await withPartitions('etcd', { ttlMs: 2_000, seconds: ETCD_SECONDS });
        const context = `\n${result.text}`;
        expect(result.faults['member-kill'] ?? 0, context).toBeGreaterThan(0);
        expect(result.faults['member-pause'] ?? 0, context).toBeGreaterThan(0);
      },
      timeout(ETCD_SECONDS),
    );
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
        // `?? 0` as in runs.ts: a matcher given undefined throws without the context.
        expect(result.replication?.failbacks ?? 0, context).toBeGreaterThanOrEqual(2);
        expect(result.replication?.grantsOnOldPrimary ?? 0, context).toBeGreaterThan(0);
        expect(result.replication?.grantsOnNewPrimary ?? 0, context).toBeGreaterThan(0);
      },
      timeout(REPLICATION_SECONDS),
    );
  },
);
