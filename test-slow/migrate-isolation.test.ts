/**
 * `palisade migrate` from 8 replicas at once at the default isolations `npm test` leaves out
 * (test/cli/migrate.test.ts runs serializable): the same scenario, the same expectations.
 */
import { afterEach, describe, it } from 'vitest';
import { killAllCli } from '../test/support/cli.js';
import { migrateFromReplicas } from '../test/support/migrate-replicas.js';
import { needs } from '../test/support/services.js';

afterEach(killAllCli);

describe.runIf(needs('DATABASE_URL'))('palisade migrate from 8 processes at once (real Postgres)', () => {
  it.each(['read committed', 'repeatable read'])(
    'at the default isolation %s: all 8 exit 0 and each migration is applied exactly once',
    { timeout: 180_000 },
    (isolation) => migrateFromReplicas(isolation),
  );
});
