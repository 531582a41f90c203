import { fileURLToPath } from 'node:url';
import { sql } from 'drizzle-orm';
import { readMigrationFiles } from 'drizzle-orm/migrator';
import { type Database, execute, transaction } from './driver.js';

/** Where palisade's own drizzle-kit migrations ship: `drizzle/` at the package root. */
export const PALISADE_MIGRATIONS = fileURLToPath(new URL('../drizzle', import.meta.url));

// A fixed 64-bit advisory-lock key: the first 8 bytes of sha256('palisade:migrate').
const MIGRATE_LOCK_KEY = -2388068382059084358n;

/** Options of {@link migrate}. */
export interface MigrateOptions {
  /** An application's drizzle-kit migrations folder, applied after palisade's own. */
  readonly migrationsFolder?: string;
  /** Where the application's applied migrations are recorded (drizzle's default: `drizzle.__drizzle_migrations`). */
  readonly migrationsTable?: string;
  readonly migrationsSchema?: string;
}

/**
 * Applies palisade's own migrations (schema `palisade`: fence sequences,
 * lease table) and, if given, the application's drizzle-kit folder.
 *
 * Safe for many replicas starting at once: everything runs in one
 * transaction that first takes a transaction-scoped advisory lock, so the
 * others wait, then see the migrations as applied and skip them (drizzle's
 * own migrator takes no lock; drizzle-orm issue #874). Each folder is
 * tracked in its own table, because drizzle decides what is pending by
 * comparing timestamps.
 *
 * Does not: roll back a migration that fails half-way outside Postgres'
 * transactional DDL, or coordinate with migrators that do not take the lock.
 */
export async function migrate(db: Database, options: MigrateOptions = {}): Promise<void> {
  await transaction(db, async (tx) => {
    await tx.execute(sql`select pg_advisory_xact_lock(${MIGRATE_LOCK_KEY})`);
    await applyFolder(tx, { migrationsFolder: PALISADE_MIGRATIONS, migrationsTable: '__palisade_migrations' });
    if (options.migrationsFolder) {
      await applyFolder(tx, {
        migrationsFolder: options.migrationsFolder,
        ...(options.migrationsTable ? { migrationsTable: options.migrationsTable } : {}),
        ...(options.migrationsSchema ? { migrationsSchema: options.migrationsSchema } : {}),
      });
    }
  });
}

// drizzle's own loop (PgDialect.migrate), on our transaction: it would open
// a transaction of its own, which a transaction's session cannot do.
async function applyFolder(
  tx: Database,
  config: { migrationsFolder: string; migrationsTable?: string; migrationsSchema?: string },
) {
  const migrations = readMigrationFiles(config);
  const table = sql`${sql.identifier(config.migrationsSchema ?? 'drizzle')}.${sql.identifier(config.migrationsTable ?? '__drizzle_migrations')}`;
  await tx.execute(sql`create schema if not exists ${sql.identifier(config.migrationsSchema ?? 'drizzle')}`);
  await tx.execute(
    sql`create table if not exists ${table} (id serial primary key, hash text not null, created_at bigint)`,
  );
  const [last] = await execute(tx, sql`select created_at from ${table} order by created_at desc limit 1`);
  const lastMillis = last ? Number(last.created_at) : Number.NEGATIVE_INFINITY;
  for (const migration of migrations) {
    if (migration.folderMillis <= lastMillis) continue;
    for (const statement of migration.sql) await tx.execute(sql.raw(statement));
    await tx.execute(
      sql`insert into ${table} (hash, created_at) values (${migration.hash}, ${migration.folderMillis})`,
    );
  }
}
