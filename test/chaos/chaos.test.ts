/**
 * A bounded chaos run with partitions on the Redis backend (the one with the
 * most moving parts: a fair queue, handoffs, epochs); what a run checks is in
 * ./runs.ts. The same run on the Postgres lease and advisory backends, and
 * the replication nemesis, are in the slow suite (test-slow/chaos.test.ts);
 * the long run for the README is `npm run chaos` (docs/chaos-report.md).
 */
import { describe, it } from 'vitest';
import { needs } from '../support/services.js';
import { SECONDS, timeout, title, withPartitions } from './runs.js';

// REDIS_URL's server is not used (the run FLUSHDBs and restarts a redis-server of its own); it marks where Redis runs.
describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL') && needs('REDIS_SERVER'))(
  'chaos: redis backend (a private redis-server)',
  () => {
    it(title, () => withPartitions('redis'), timeout(SECONDS));
  },
);
