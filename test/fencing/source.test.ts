/**
 * A database's fence source id (README, "Two scopes of fencing"): read from
 * `palisade.fence_source_id()`, and a typed error that names the migration
 * when the database lacks it, whichever part is missing.
 */
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import { afterEach, describe, expect, it, onTestFinished } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { FenceSourceError } from '../../src/errors.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import { databaseSourceId } from '../../src/fencing/source.js';
import { migrate } from '../../src/migrate.js';
import { pgliteDatabase, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { createScratchDatabase } from '../support/scratch-database.js';
import { needs, services } from '../support/services.js';

describe('the fence source id of a database (PGlite)', { timeout: 60_000 }, () => {
  let test: TestDatabase | undefined;
  afterEach(async () => {
    await test?.close();
    test = undefined;
  });

  it('is read once the migrations ran, bounded or not, and is the same id each time', async () => {
    test = await pgliteDatabase();
    await migrate(test.db);
    const id = await databaseSourceId(test.db);
    expect(id).toMatch(/^pg:[0-9a-f]{32}$/);
    expect(await databaseSourceId(test.db, 1_000)).toBe(id);
  });

  it('without the migrations — no schema, then no function — is a FenceSourceError that names them', async () => {
    test = await pgliteDatabase();
    for (const lockWaitMs of [undefined, 1_000]) {
      await expect(databaseSourceId(test.db, lockWaitMs)).rejects.toThrow(FenceSourceError);
    }
    await execute(test.db, sql`create schema palisade`);
    const err = await databaseSourceId(test.db).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(FenceSourceError);
    expect((err as Error).message).toMatch(/migrations \(0005\)/);
  });

  it('with its row removed is a FenceSourceError, not an empty id', async () => {
    test = await pgliteDatabase();
    await migrate(test.db);
    await execute(test.db, sql`delete from palisade.fence_sources`);
    await expect(databaseSourceId(test.db)).rejects.toThrow(/holds no id/);
  });
});

describe.runIf(needs('DATABASE_URL'))(
  'a lock manager on a database that lost the function',
  { timeout: 60_000 },
  () => {
    // A database migrated before 0005 has the fence sequences and no fence_source_id(): the managers that
    // claim at grant read the id first, a Redis manager with its first epoch, and say which migration is missing.
    it('fails its first acquire with FenceSourceError, on the lease, advisory and Redis backends', async () => {
      const scratch = await createScratchDatabase(services.postgres.url as string);
      const client = postgres(scratch.url, { max: 4, onnotice: () => {} });
      const db = drizzle(client) as unknown as Database;
      try {
        await migrate(db);
        await execute(db, sql`alter function palisade.fence_source_id() rename to fence_source_id_gone`);
        const redis = services.redis.url ? new Redis(services.redis.url) : undefined;
        onTestFinished(() => redis?.disconnect());
        const managers = [
          postgresLockManager({ client: db, namespace: uniqueNamespace('source'), listen: false }),
          advisoryLockManager({ client, namespace: uniqueNamespace('source') }),
          // The Redis manager reads it with its first epoch, from the same database.
          ...(redis ? [redisLockManager({ client: redis, namespace: uniqueNamespace('source'), epochs: db })] : []),
        ];
        try {
          for (const manager of managers) {
            await expect(manager.acquire('L', { ttlMs: 10_000 })).rejects.toThrow(FenceSourceError);
          }
        } finally {
          await Promise.all(managers.map((m) => m.close()));
        }
      } finally {
        await client.end({ timeout: 5 });
        await scratch.drop();
      }
    });
  },
);
