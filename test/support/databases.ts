import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import type { Database } from '../../src/driver.js';
import { newPglite } from './pglite.js';
import { createScratchDatabase } from './scratch-database.js';
import { services } from './services.js';

/** A database of a test's own: dropped (or discarded) by `close()`. */
export interface TestDatabase {
  readonly driver: 'pglite' | 'postgres' | 'node-postgres';
  readonly db: Database;
  /** For the real Postgres: a URL of this test's own database, for child processes. */
  readonly url?: string;
  close(): Promise<void>;
}

/** An in-memory PGlite (./pglite.ts): one per test file or suite, not per test (each takes a second and hundreds of MB). */
export async function pgliteDatabase(): Promise<TestDatabase> {
  const client = newPglite();
  const db = drizzlePglite(client) as unknown as Database;
  return { driver: 'pglite', db, close: () => client.close() };
}

/** A fresh database on the real Postgres (`DATABASE_URL`), so tests run in parallel and twice in a row. `max`: the pool's size. */
export async function postgresDatabase({ max = 20 }: { max?: number } = {}): Promise<TestDatabase> {
  const base = services.postgres.url;
  if (!base) throw new Error('DATABASE_URL is not set');
  const { url, drop } = await createScratchDatabase(base);
  const client = postgres(url, { max, onnotice: () => {} });
  const db = drizzlePostgres(client) as unknown as Database;
  return {
    driver: 'postgres',
    db,
    url,
    async close() {
      // 1 s: a connection the server closed inside a palisade transaction stays "busy" for postgres.js (README).
      await client.end({ timeout: 1 });
      await drop();
    },
  };
}

/** A fresh database on the real Postgres, through node-postgres (`pg.Pool`) instead of postgres.js. `max`: the pool's size. */
export async function nodePostgresDatabase({ max = 20 }: { max?: number } = {}): Promise<TestDatabase> {
  const base = services.postgres.url;
  if (!base) throw new Error('DATABASE_URL is not set');
  const { url, drop } = await createScratchDatabase(base);
  const pool = new pg.Pool({ connectionString: url, max });
  pool.on('error', () => {}); // an idle client's connection dropped: the pool replaces it
  const db = drizzleNodePostgres(pool) as unknown as Database;
  return {
    driver: 'node-postgres',
    db,
    url,
    async close() {
      await pool.end();
      await drop();
    },
  };
}

/** The drivers a repository suite runs on: PGlite always; postgres.js and node-postgres on the real Postgres when configured. */
export const drivers: { name: TestDatabase['driver']; open: () => Promise<TestDatabase> }[] = [
  { name: 'pglite', open: pgliteDatabase },
  ...(services.postgres.url
    ? [
        { name: 'postgres' as const, open: postgresDatabase },
        { name: 'node-postgres' as const, open: nodePostgresDatabase },
      ]
    : []),
];

/**
 * A fresh database on the real Postgres through one node-postgres `Client`, not a pool: drizzle runs its
 * transactions on the database's own session.
 */
export async function singleClientDatabase(): Promise<TestDatabase> {
  const t = await nodePostgresDatabase({ max: 1 });
  const client = new pg.Client({ connectionString: t.url });
  await client.connect();
  client.on('error', () => {}); // a connection the test ends: the next statement says so
  return {
    driver: 'node-postgres',
    db: drizzleNodePostgres(client) as unknown as Database,
    url: t.url,
    async close() {
      await client.end();
      await t.close();
    },
  };
}

/**
 * Every way palisade runs a transaction, for a suite that checks one promise on each: PGlite always
 * (`real: false`); postgres.js, a node-postgres pool and a single node-postgres `Client` on the real
 * Postgres (a pool of 4 each).
 */
export const everyTransactionDriver = [
  { name: 'PGlite', open: pgliteDatabase, real: false },
  { name: 'postgres.js', open: () => postgresDatabase({ max: 4 }), real: true },
  { name: 'node-postgres', open: () => nodePostgresDatabase({ max: 4 }), real: true },
  { name: 'a single node-postgres Client', open: singleClientDatabase, real: true },
] as const;
