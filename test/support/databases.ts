import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import type { Database } from '../../src/driver.js';
import { migrate } from '../../src/migrate.js';
import { newPglite } from './pglite.js';
import { createScratchDatabase } from './scratch-database.js';
import { services } from './services.js';
import { migratedTemplate } from './template-database.js';

/** A database of a test's own: dropped (or discarded) by `close()`. */
export interface TestDatabase {
  readonly driver: 'pglite' | 'postgres' | 'node-postgres';
  readonly db: Database;
  /** For the real Postgres: a URL of this test's own database, for child processes. */
  readonly url?: string;
  close(): Promise<void>;
}

/** Whether a test database starts with palisade migrated. */
interface Migrated {
  /**
   * Palisade's migrations applied, as `migrate(db)` leaves a new database. On the real Postgres, a copy of
   * the run's migrated template (./template-database.ts): a fraction of the time a migration takes.
   * Default: empty.
   */
  readonly migrated?: boolean;
}

/**
 * An in-memory PGlite (./pglite.ts): one per test file or suite, not per test (each takes a second and
 * hundreds of MB). `migrated`: palisade's migrations applied.
 */
export async function pgliteDatabase({ migrated = false }: Migrated = {}): Promise<TestDatabase> {
  const client = newPglite();
  const db = drizzlePglite(client) as unknown as Database;
  if (migrated) await migrate(db);
  return { driver: 'pglite', db, close: () => client.close() };
}

/** How a database on the real Postgres is opened. */
export interface RealDatabaseOptions extends Migrated {
  /** The pool's size (default 20). */
  readonly max?: number;
}

/** A fresh database on the real Postgres (`DATABASE_URL`), so tests run in parallel and twice in a row. */
export async function postgresDatabase({
  max = 20,
  migrated = false,
}: RealDatabaseOptions = {}): Promise<TestDatabase> {
  const { url, drop } = await scratchDatabase(migrated);
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

/** A fresh database on the real Postgres, through node-postgres (`pg.Pool`) instead of postgres.js. */
export async function nodePostgresDatabase({
  max = 20,
  migrated = false,
}: RealDatabaseOptions = {}): Promise<TestDatabase> {
  const { url, drop } = await scratchDatabase(migrated);
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

function scratchDatabase(migrated: boolean) {
  const base = services.postgres.url;
  if (!base) throw new Error('DATABASE_URL is not set');
  return createScratchDatabase(base, 'palisade_t', migrated ? migratedTemplate() : undefined);
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
export async function singleClientDatabase(o?: Migrated): Promise<TestDatabase> {
  const t = await nodePostgresDatabase({ max: 1, ...o });
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
  // `max` is a pool's size: PGlite has one session.
  { name: 'PGlite', open: (o?: RealDatabaseOptions) => pgliteDatabase(o), real: false },
  { name: 'postgres.js', open: (o?: RealDatabaseOptions) => postgresDatabase({ max: 4, ...o }), real: true },
  { name: 'node-postgres', open: (o?: RealDatabaseOptions) => nodePostgresDatabase({ max: 4, ...o }), real: true },
  { name: 'a single node-postgres Client', open: singleClientDatabase, real: true },
] as const;
