/**
 * The lock backend contract (palisade-db/testing's describeLockBackend) on
 * the built-in backends that need only Postgres and Redis; etcd runs it in
 * test-slow/etcd.test.ts beside its cluster (the slow suite).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { describeLockBackend } from '../../src/testing/contract.js';
import type { TestDatabase } from '../support/databases.js';
import { builtInContract } from '../support/lock-backends.js';
import { scenarioDatabase } from '../support/scenario.js';
import { needs } from '../support/services.js';

describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL'))('built-in lock backends', () => {
  let test: TestDatabase;
  beforeAll(async () => {
    test = await scenarioDatabase();
  });
  afterAll(async () => {
    await test?.close();
  });
  const where = () => ({ databaseUrl: test.url ?? '', redisUrl: process.env.REDIS_URL });
  describeLockBackend('postgres lease', { describe, it, expect }, builtInContract('postgres', where));
  describeLockBackend('postgres advisory', { describe, it, expect }, builtInContract('advisory', where));
  describeLockBackend('redis', { describe, it, expect }, builtInContract('redis', where));
});
