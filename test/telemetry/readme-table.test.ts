/**
 * The README's metric table is a claim about what an OpenTelemetry SDK
 * receives. Drive every instrumented path on the real services — grants,
 * a timeout, a lost lease, a stale write, a Redis fence counter that starts
 * missing (epoch recovery from Postgres), a migrate() that waits for another
 * migrator — then compare the table with the metrics the SDK exported:
 * names, instrument kinds, units and attribute keys.
 */
import { readFileSync } from 'node:fs';
import { DataPointType } from '@opentelemetry/sdk-metrics';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import { toFence } from '../../src/fencing/fence.js';
import { MIGRATE_LOCK_KEY, migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { METRICS } from '../../src/telemetry/catalog.js';
import { configureTelemetry } from '../../src/telemetry/otel.js';
import { createAccounts } from '../repo/fixtures.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { type TestSdk, testSdk } from './support.js';

interface Row {
  name: string;
  instrument: string;
  unit: string;
  attributes: string[];
}

/** The rows of the table in the README's OpenTelemetry section. */
function readmeTable(): Row[] {
  const readme = readFileSync('README.md', 'utf8');
  const section = readme.slice(readme.indexOf('## Watching it in production: OpenTelemetry'));
  const body = section.slice(0, section.indexOf('\n## ', 1));
  const rows: Row[] = [];
  for (const line of body.split('\n')) {
    const cells = line.split('|').map((c) => c.trim());
    const name = /^`(palisade\.[a-z_.]+)`$/.exec(cells[1] ?? '')?.[1];
    if (!name) continue;
    rows.push({
      name,
      instrument: cells[2] ?? '',
      unit: (cells[3] ?? '').replaceAll('`', ''),
      attributes: [...(cells[4] ?? '').matchAll(/`([a-z_]+\.[a-z_.]+)`/g)].map((m) => m[1] as string).sort(),
    });
  }
  return rows;
}

describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL'))('the README metric table (real Postgres and Redis)', () => {
  let test: TestDatabase;
  let sdk: TestSdk;
  let redis: Redis;

  beforeAll(async () => {
    test = await postgresDatabase();
    await migrate(test.db);
    sdk = testSdk();
    configureTelemetry({ meterProvider: sdk.meterProvider, tracerProvider: sdk.tracerProvider });
    redis = new Redis(process.env.REDIS_URL as string, { commandTimeout: 2_000, maxRetriesPerRequest: 1 });
  });
  afterAll(async () => {
    configureTelemetry();
    await sdk?.shutdown();
    redis?.disconnect();
    await test?.close();
  });

  it('lists exactly the instruments the SDK received, with their kinds, units and attribute keys', async () => {
    const db = test.db;
    // Lock paths: a grant, a timeout, an extension, a release, a lost lease.
    const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('otel-readme') });
    const lease = await locks.acquire('job', { ttlMs: 10_000 });
    await expect(locks.acquire('job', { ttlMs: 1000, waitMs: 20 })).rejects.toMatchObject({ reason: 'timeout' });
    await lease.extend();
    await lease.release();
    const short = await locks.acquire('short', { ttlMs: 50 });
    await new Promise<void>((resolve) => short.signal.addEventListener('abort', () => resolve(), { once: true }));
    await short.release();
    await locks.close();

    // A refused write.
    const accounts = await createAccounts(db);
    const repo = fencedRepository(db, accounts);
    await repo.upsert({ id: 'a' }, toFence(10n));
    expect((await repo.update({ id: 'a' }, toFence(9n), { balance: 1 })).status).toBe('stale');

    // Redis with a durable floor: a fresh namespace's fence counter is missing, so the first grant
    // recovers an epoch from Postgres (recovery, floor check, new epoch).
    const namespace = uniqueNamespace('otel-readme');
    const redisLocks = redisLockManager({ client: redis, namespace, epochs: db });
    try {
      await (await redisLocks.acquire('job', { ttlMs: 5_000 })).release();
    } finally {
      await redisLocks.close();
      const keys = await redis.keys(`{palisade:${namespace}}*`);
      if (keys.length > 0) await redis.del(...keys);
    }

    // A migrate() that waits for another migrator (the real Postgres: advisory locks block there).
    const other = postgres(test.url as string, { max: 1, onnotice: () => {} });
    try {
      let waiting!: () => void;
      const isWaiting = new Promise<void>((resolve) => {
        waiting = resolve;
      });
      const holder = other.begin(async (tx) => {
        await tx`select pg_advisory_xact_lock(${MIGRATE_LOCK_KEY.toString()}::bigint)`;
        const second = migrate(db, { onProgress: (e) => e.type === 'waiting' && waiting() });
        await isWaiting;
        return { second }; // wrapped: the transaction must commit (freeing the lock) before it settles
      });
      const result = await (await holder).second;
      expect(result.waited).toBe(true);
    } finally {
      await other.end({ timeout: 5 });
    }

    const exported = await sdk.metrics();
    const received = exported
      .map((m) => ({
        name: m.descriptor.name,
        instrument:
          m.dataPointType === DataPointType.HISTOGRAM
            ? 'histogram'
            : m.dataPointType === DataPointType.SUM && m.isMonotonic
              ? 'counter'
              : String(m.dataPointType),
        unit: m.descriptor.unit,
        attributes: [...new Set(m.dataPoints.flatMap((p) => Object.keys(p.attributes)))].sort(),
        points: m.dataPoints.length,
      }))
      .sort((a, b) => a.name.localeCompare(b.name));
    const table = readmeTable().sort((a, b) => a.name.localeCompare(b.name));

    expect(table.length).toBe(METRICS.length);
    expect(received.every((m) => m.points > 0)).toBe(true);
    expect(received.map(({ points: _, ...m }) => m)).toEqual(table);
    expect(table.map((r) => r.name).sort()).toEqual(METRICS.map((m) => m.name).sort());
  });
});
