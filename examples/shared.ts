/**
 * The little every example needs to run from a terminal: a database from
 * `DATABASE_URL`, a log line per event, and "am I the script being run?".
 * Nothing here is palisade; it keeps the examples themselves short.
 */
import { realpathSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { type SQL, sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/postgres-js';
import { type Database, MIGRATE_LOCK_KEY } from 'palisade-db';
import postgres from 'postgres';

/** A postgres.js client and a drizzle database on `DATABASE_URL`. */
export interface Connection {
  readonly sql: postgres.Sql;
  readonly db: Database;
  close(): Promise<void>;
}

/** Connects to `DATABASE_URL`, or exits with one line saying it is needed. */
export function connectFromEnv(example: string): Connection {
  const url = process.env.DATABASE_URL;
  if (!url) {
    process.stderr.write(`${example}: set DATABASE_URL (e.g. postgres://postgres@127.0.0.1:5432/postgres)\n`);
    process.exit(1);
  }
  return connect(url);
}

/** A small pool on `url`, with notices silenced. */
export function connect(url: string, max = 4): Connection {
  const sql = postgres(url, { max, onnotice: () => {}, connect_timeout: 10 });
  return { sql, db: drizzle(sql) as unknown as Database, close: () => sql.end({ timeout: 5 }) };
}

/** Prints an example's events as `[name pid] type key=value …`, bigints as decimals. */
export function logEvents(name: string): (event: { readonly type: string }) => void {
  return (event) => {
    const { type, ...rest } = event as Record<string, unknown>;
    const fields = Object.entries(rest)
      .map(
        ([k, v]) =>
          `${k}=${typeof v === 'string' || typeof v === 'bigint' ? String(v) : JSON.stringify(v, (_k, x) => (typeof x === 'bigint' ? String(x) : x))}`,
      )
      .join(' ');
    process.stdout.write(`[${name} ${process.pid}] ${String(type)}${fields ? ` ${fields}` : ''}\n`);
  };
}

/** True when the module at `importMetaUrl` is the script node was asked to run. */
export function isMain(importMetaUrl: string): boolean {
  const script = process.argv[1];
  if (!script) return false;
  try {
    return realpathSync(script) === realpathSync(fileURLToPath(importMetaUrl));
  } catch {
    return false;
  }
}

/** `host-pid`: who holds a lock, for `inspect` and `palisade locks`. */
export function holderLabel(role: string): string {
  return `${role} pid ${process.pid}`;
}

/**
 * Runs an example's `create table if not exists …` statements in one
 * transaction under palisade's migration lock, so two copies started at
 * once do not race on creating the same table. (A real application ships
 * these as drizzle-kit migrations and runs `palisade migrate`.)
 */
export async function createTables(db: Database, statements: readonly SQL[]): Promise<void> {
  await db.transaction(async (tx) => {
    await tx.execute(sql`select pg_advisory_xact_lock(${MIGRATE_LOCK_KEY})`);
    for (const statement of statements) await tx.execute(statement);
  });
}
