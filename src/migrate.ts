import { existsSync, readFileSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { sql } from 'drizzle-orm';
import { readMigrationFiles } from 'drizzle-orm/migrator';
import { assertSupportedDriver, type Database, execute, isTransaction, transaction } from './driver.js';
import { InvalidArgumentError, LockUnavailableError, MigrationsFolderError } from './errors.js';
import { sqlStateOf } from './server-error.js';
import { recordMigrateWait } from './telemetry/otel.js';

/** Where palisade's own drizzle-kit migrations ship: `drizzle/` at the package root. */
export const PALISADE_MIGRATIONS = fileURLToPath(new URL('../drizzle', import.meta.url));

/**
 * The 64-bit advisory-lock key every `migrate()` takes (the first 8 bytes of
 * sha256('palisade:migrate')). In `pg_locks` it shows as
 * `classid = 3738951797, objid = 2215036346, objsubid = 1`.
 */
export const MIGRATE_LOCK_KEY = -2388068382059084358n;

/** The name `LockUnavailableError` carries when the migration lock was not obtained in time. */
export const MIGRATE_LOCK_NAME = 'palisade:migrate';

const DEFAULT_LOCK_TIMEOUT_MS = 600_000;
const MAX_LOCK_TIMEOUT_MS = 86_400_000;

/** Options of {@link migrate}. */
export interface MigrateOptions {
  /**
   * An application's drizzle-kit migrations folder (the one holding
   * `meta/_journal.json`), applied after palisade's own. A relative path is
   * resolved against the process's working directory, not the source file:
   * a bundled app must ship the folder beside the bundle and pass its path.
   */
  readonly migrationsFolder?: string;
  /**
   * Where palisade's own migrations are (default {@link PALISADE_MIGRATIONS},
   * the package's `drizzle/` folder). Only a bundle that inlines palisade-db
   * needs it: copy `node_modules/palisade-db/drizzle` beside the bundle and
   * pass its path.
   */
  readonly palisadeMigrationsFolder?: string;
  /** Where the application's applied migrations are recorded (drizzle's default: `drizzle.__drizzle_migrations`). */
  readonly migrationsTable?: string;
  readonly migrationsSchema?: string;
  /**
   * How long to wait for another migrator to finish (default 600,000 ms = 10
   * minutes; an integer in 1 … 86,400,000). Enforced by Postgres
   * (`lock_timeout`) while waiting for the lock only.
   */
  readonly lockTimeoutMs?: number;
  /** Called synchronously as the migration progresses (errors thrown by it are ignored). */
  readonly onProgress?: (event: MigrateEvent) => void;
}

/** What {@link migrate} reports while it works. */
export type MigrateEvent =
  | { readonly type: 'waiting' }
  | { readonly type: 'locked'; readonly waited: boolean }
  | { readonly type: 'applying'; readonly folder: 'palisade' | 'app'; readonly tag: string }
  | { readonly type: 'applied'; readonly folder: 'palisade' | 'app'; readonly tag: string };

/** One migration as {@link migrate} saw it. */
export interface MigrationInfo {
  readonly folder: 'palisade' | 'app';
  /** The journal's tag (`0001_fence_widgets`), or the timestamp when the journal has none. */
  readonly tag: string;
  readonly hash: string;
}

/** What one {@link migrate} call did. */
export interface MigrateResult {
  /** Migrations this call applied, in order. Empty when another replica had applied them all. */
  readonly applied: readonly MigrationInfo[];
  /** Migrations already recorded as applied, which this call skipped. */
  readonly skipped: readonly MigrationInfo[];
  /** Whether this call had to wait for another migrator first. */
  readonly waited: boolean;
}

/** Where palisade's own applied migrations are recorded, in schema `drizzle`. */
const PALISADE_MIGRATIONS_TABLE = '__palisade_migrations';

/**
 * Applies palisade's own migrations (schema `palisade`: fence sequences,
 * lease table) and, if given, the application's drizzle-kit folder.
 *
 * Safe for many replicas starting at once: everything runs in one
 * transaction that first takes a transaction-scoped advisory lock
 * ({@link MIGRATE_LOCK_KEY}), so the others wait, then see the migrations as
 * applied and skip them (drizzle's own migrator takes no lock; drizzle-orm
 * issue #874). Each folder is tracked in its own table, because drizzle
 * decides what is pending by comparing timestamps. On a postgres.js pool the
 * transaction holds one connection; a dedicated `max: 1` client is enough.
 *
 * Guarantees: each migration is applied at most once per database and
 * recorded in the same transaction as its statements; if any statement
 * fails, nothing of this call is kept. The wait for the lock is bounded
 * (`lockTimeoutMs`).
 *
 * Does not: coordinate with migrators that do not take the lock (drizzle-kit
 * `migrate`, another tool); undo what a migration did outside Postgres'
 * transactional DDL (e.g. `CREATE INDEX CONCURRENTLY` cannot run here at
 * all); block on PGlite, whose advisory locks never wait (one process owns it).
 *
 * Emits no NOTICEs (`client_min_messages` is raised for its own
 * transaction), so a driver's default notice logging stays quiet.
 *
 * @throws {LockUnavailableError} (lock name {@link MIGRATE_LOCK_NAME}) if another migrator held the lock past `lockTimeoutMs`.
 * @throws {InvalidArgumentError} for a bad `lockTimeoutMs` or folder option, `migrationsTable` naming palisade's own table, or an unsupported driver — before any query.
 * @throws {MigrationsFolderError} naming the path, if a folder is missing, has no `meta/_journal.json`, or lists a migration file that cannot be read — before any query.
 */
export async function migrate(db: Database, options: MigrateOptions = {}): Promise<MigrateResult> {
  assertSupportedDriver(db, 'migrate');
  if (options === null || typeof options !== 'object')
    throw new InvalidArgumentError('migrate options must be an object');
  const lockTimeoutMs = options.lockTimeoutMs ?? DEFAULT_LOCK_TIMEOUT_MS;
  if (!Number.isInteger(lockTimeoutMs) || lockTimeoutMs < 1 || lockTimeoutMs > MAX_LOCK_TIMEOUT_MS) {
    throw new InvalidArgumentError(`lockTimeoutMs must be an integer in 1 … ${MAX_LOCK_TIMEOUT_MS}`);
  }
  // The application's records in palisade's table: palisade's dates would mark its migrations applied.
  if ((options.migrationsSchema || 'drizzle') === 'drizzle' && options.migrationsTable === PALISADE_MIGRATIONS_TABLE) {
    throw new InvalidArgumentError(`migrationsTable ${PALISADE_MIGRATIONS_TABLE} is palisade's own: name another`);
  }
  const palisadeFolder =
    folderOption(options.palisadeMigrationsFolder, 'palisadeMigrationsFolder') ?? PALISADE_MIGRATIONS;
  const appFolder = folderOption(options.migrationsFolder, 'migrationsFolder');
  // Read (and so check) every file before the transaction: a bad folder is a setup error, not a database error.
  const palisadeMigrations = readFolder(palisadeFolder, 'palisade');
  const appMigrations = appFolder === undefined ? undefined : readFolder(appFolder, 'app');
  const report = (event: MigrateEvent) => {
    try {
      options.onProgress?.(event);
    } catch {
      // Progress reporting must not change what the migration does.
    }
  };
  const applied: MigrationInfo[] = [];
  const skipped: MigrationInfo[] = [];
  let waited = false;
  const inCallersTransaction = isTransaction(db);
  await transaction(db, async (tx) => {
    // Whatever the database's default: a replica that waited for the lock must read what the one
    // before it committed, which a snapshot taken before the wait (REPEATABLE READ) cannot see. Only
    // in a transaction of our own: a caller's transaction keeps the level it chose (Postgres refuses
    // a change of level in a savepoint or after a query).
    if (!inCallersTransaction) await tx.execute(sql`set transaction isolation level read committed`);
    // `create … if not exists` on a rerun would emit NOTICEs, which postgres.js prints by default.
    await execute(tx, sql`select set_config('client_min_messages', 'warning', true)`);
    const [free] = await execute(tx, sql`select pg_try_advisory_xact_lock(${MIGRATE_LOCK_KEY}) as locked`);
    if (free?.locked !== true) {
      waited = true;
      report({ type: 'waiting' });
      const waitStarted = performance.now();
      const [previous] = await execute(tx, sql`select current_setting('lock_timeout') as value`);
      await execute(tx, sql`select set_config('lock_timeout', ${`${lockTimeoutMs}ms`}, true)`);
      try {
        await tx.execute(sql`select pg_advisory_xact_lock(${MIGRATE_LOCK_KEY})`);
      } catch (err) {
        recordMigrateWait(waitStarted, sqlStateOf(err) === '55P03' ? 'timeout' : 'error');
        if (sqlStateOf(err) === '55P03') throw new LockUnavailableError(MIGRATE_LOCK_NAME, 'timeout');
        throw err;
      }
      recordMigrateWait(waitStarted, 'locked');
      await execute(tx, sql`select set_config('lock_timeout', ${String(previous?.value ?? '0')}, true)`);
    }
    report({ type: 'locked', waited });
    const folders = [
      { folder: 'palisade' as const, read: palisadeMigrations, migrationsTable: PALISADE_MIGRATIONS_TABLE },
      ...(appMigrations
        ? [
            {
              folder: 'app' as const,
              read: appMigrations,
              ...(options.migrationsTable ? { migrationsTable: options.migrationsTable } : {}),
              ...(options.migrationsSchema ? { migrationsSchema: options.migrationsSchema } : {}),
            },
          ]
        : []),
    ];
    for (const config of folders) await applyFolder(tx, config, { applied, skipped, report });
  });
  return { applied, skipped, waited };
}

// drizzle's own loop (PgDialect.migrate), on our transaction: it would open
// a transaction of its own, which a transaction's session cannot do.
async function applyFolder(
  tx: Database,
  config: { folder: 'palisade' | 'app'; read: ReadFolder; migrationsTable?: string; migrationsSchema?: string },
  out: { applied: MigrationInfo[]; skipped: MigrationInfo[]; report: (event: MigrateEvent) => void },
) {
  const { migrations, tags } = config.read;
  const table = sql`${sql.identifier(config.migrationsSchema ?? 'drizzle')}.${sql.identifier(config.migrationsTable ?? '__drizzle_migrations')}`;
  await tx.execute(sql`create schema if not exists ${sql.identifier(config.migrationsSchema ?? 'drizzle')}`);
  await tx.execute(
    sql`create table if not exists ${table} (id serial primary key, hash text not null, created_at bigint)`,
  );
  const [last] = await execute(tx, sql`select created_at from ${table} order by created_at desc limit 1`);
  const lastMillis = last ? Number(last.created_at) : Number.NEGATIVE_INFINITY;
  for (const migration of migrations) {
    const info = {
      folder: config.folder,
      tag: tags.get(migration.folderMillis) ?? String(migration.folderMillis),
      hash: migration.hash,
    };
    if (migration.folderMillis <= lastMillis) {
      out.skipped.push(info);
      continue;
    }
    out.report({ type: 'applying', folder: info.folder, tag: info.tag });
    for (const statement of migration.sql) {
      // A chunk of comments only (drizzle-kit's custom-file header before a breakpoint) is no statement.
      if (isBlank(statement)) continue;
      await tx.execute(sql.raw(statement));
    }
    await tx.execute(
      sql`insert into ${table} (hash, created_at) values (${migration.hash}, ${migration.folderMillis})`,
    );
    out.applied.push(info);
    out.report({ type: 'applied', folder: info.folder, tag: info.tag });
  }
}

interface ReadFolder {
  readonly migrations: ReturnType<typeof readMigrationFiles>;
  readonly tags: Map<number, string>;
}

function folderOption(value: unknown, name: string): string | undefined {
  if (value === undefined) return undefined;
  if (typeof value !== 'string' || value.trim() === '' || value.includes('\0')) {
    throw new InvalidArgumentError(`${name} must be a non-empty path`);
  }
  return value;
}

// Paths in messages are the caller's own configuration, never row data.
function readFolder(folder: string, which: 'palisade' | 'app'): ReadFolder {
  const path = resolve(folder);
  const whose = which === 'palisade' ? "palisade's own migrations" : 'migrations folder';
  const hint =
    which === 'palisade'
      ? 'the package ships them in drizzle/; a bundle that inlines palisade-db must copy that folder and pass palisadeMigrationsFolder'
      : 'pass the folder drizzle-kit generates into (it holds meta/_journal.json); a bundled app must ship that folder beside the bundle';
  if (!existsSync(path) || !statSync(path).isDirectory()) {
    throw new MigrationsFolderError(path, `${whose} not found: ${path} does not exist or is not a directory (${hint})`);
  }
  if (!existsSync(join(path, 'meta', '_journal.json'))) {
    throw new MigrationsFolderError(
      path,
      `${whose} ${path} has no meta/_journal.json: not a drizzle-kit folder (${hint})`,
    );
  }
  try {
    return { migrations: readMigrationFiles({ migrationsFolder: path }), tags: journalTags(path) };
  } catch (err) {
    throw new MigrationsFolderError(
      path,
      `${whose} ${path} cannot be read: ${err instanceof Error ? err.message : String(err)}`,
      err,
    );
  }
}

// readMigrationFiles has already validated the journal; here it only names the migrations.
function journalTags(folder: string): Map<number, string> {
  try {
    const journal = JSON.parse(readFileSync(join(folder, 'meta', '_journal.json'), 'utf8')) as {
      entries?: { when?: number; tag?: string }[];
    };
    return new Map((journal.entries ?? []).map((e) => [Number(e.when), String(e.tag)]));
  } catch {
    return new Map();
  }
}

function isBlank(statement: string): boolean {
  return statement.replace(/--[^\n]*/g, '').trim() === '';
}
