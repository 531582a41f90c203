/**
 * The one place that knows how drizzle's Postgres drivers differ.
 *
 * palisade runs on drizzle's `postgres-js` and `pglite` drivers (and inside
 * their transactions). They differ in what `execute` returns (an array vs
 * `{ rows }`), how int8 comes back (string vs number/bigint) and how errors
 * are wrapped. Everything above this module sees plain row objects, bigints
 * and {@link PalisadeError}s.
 */
import type { SQL } from 'drizzle-orm';
import type { PgDatabase, PgDialect, PgPreparedQuery, PgQueryResultHKT, PgSession } from 'drizzle-orm/pg-core';
import { PalisadeError, RetryableWriteError } from './errors.js';

/** A drizzle Postgres database or transaction (postgres-js or PGlite). */
// biome-ignore lint/suspicious/noExplicitAny: any schema, any driver result — narrowed in this module.
export type Database = PgDatabase<PgQueryResultHKT, any, any>;

/** A result row keyed by database column name, values as the driver returns them. */
export type RawRow = Record<string, unknown>;

/** The database refused a statement for a reason palisade does not interpret. */
export class DatabaseError extends PalisadeError {
  constructor(
    readonly sqlState: string | undefined,
    cause: unknown,
  ) {
    super('database', `database error${sqlState ? ` (SQLSTATE ${sqlState})` : ''}: ${driverMessage(cause)}`, {
      cause,
    });
  }
}

interface Internals {
  session: PgSession;
  dialect: PgDialect;
}

// drizzle keeps these public on the instance but not in its declared types.
function internals(db: Database): Internals {
  return db as unknown as Internals;
}

const preparedBySession = new WeakMap<object, Map<string, PgPreparedQuery<never>>>();

/**
 * Runs `query` once. Values are sent as parameters; the statement is not
 * cached on our side (postgres.js still prepares it by text).
 */
export async function execute(db: Database, query: SQL): Promise<RawRow[]> {
  try {
    return rowsOf(await db.execute(query));
  } catch (err) {
    throw translateError(err);
  }
}

/**
 * Returns a runner for a statement that is compiled once per session and
 * `key`: `build()` runs only on the first call, later calls only fill the
 * placeholders. Use `sql.placeholder(name)` (or `new Param(placeholder,
 * column)` to keep a column's encoder) inside the built SQL. With no `key`
 * the statement is compiled for this call only.
 */
export function prepared(
  db: Database,
  key: string | undefined,
  build: () => SQL,
): (values: Record<string, unknown>) => Promise<RawRow[]> {
  const { session, dialect } = internals(db);
  let cache = preparedBySession.get(session);
  if (!cache) {
    cache = new Map();
    preparedBySession.set(session, cache);
  }
  let query = key === undefined ? undefined : cache.get(key);
  if (!query) {
    // A name makes drizzle's postgres-js driver send a named (server-side
    // prepared) statement; without one it sends an unnamed statement that
    // postgres.js parses and describes in an extra round trip on every call.
    query = session.prepareQuery(dialect.sqlToQuery(build()), undefined, key, false) as PgPreparedQuery<never>;
    if (key !== undefined) cache.set(key, query);
  }
  const q = query;
  return async (values) => {
    try {
      return rowsOf(await q.execute(values));
    } catch (err) {
      throw translateError(err);
    }
  };
}

/** Runs `fn` in a transaction (a savepoint when `db` already is one). */
export async function transaction<T>(db: Database, fn: (tx: Database) => Promise<T>): Promise<T> {
  try {
    return await db.transaction((tx) => fn(tx as unknown as Database));
  } catch (err) {
    throw translateError(err);
  }
}

function rowsOf(result: unknown): RawRow[] {
  if (Array.isArray(result)) return result as RawRow[];
  const rows = (result as { rows?: unknown } | null)?.rows;
  if (Array.isArray(rows)) return rows as RawRow[];
  throw new PalisadeError('driver', 'unrecognised result shape from the database driver');
}

/** Reads an int8 as the drivers return it (string, number or bigint). `null` stays `null`. */
export function int8(value: unknown): bigint | null {
  if (value === null || value === undefined) return null;
  if (typeof value === 'bigint') return value;
  if (typeof value === 'number' || typeof value === 'string') return BigInt(value);
  throw new PalisadeError('driver', `expected an int8, got ${typeof value}`);
}

/** Reads a Postgres `count(*)` or other int8 that cannot be null. */
export function count(value: unknown): number {
  return Number(int8(value) ?? 0n);
}

/** The SQLSTATE of a driver error, whichever driver and however wrapped. */
export function sqlStateOf(err: unknown): string | undefined {
  for (let e: unknown = err, depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code)) return code;
  }
  return undefined;
}

/**
 * Maps a driver error to palisade's: our own errors pass through, 40001 and
 * 40P01 become {@link RetryableWriteError}, the rest {@link DatabaseError}
 * with the driver's message (drizzle's wrapper is dropped: its message
 * carries the query parameters).
 */
export function translateError(err: unknown): Error {
  if (err instanceof PalisadeError) return err;
  const state = sqlStateOf(err);
  const original = originalError(err);
  if (state === '40001' || state === '40P01') return new RetryableWriteError(state, original);
  return new DatabaseError(state, original);
}

function originalError(err: unknown): unknown {
  const cause = (err as { cause?: unknown } | null)?.cause;
  return (err as { name?: unknown } | null)?.constructor?.name === 'DrizzleQueryError' && cause ? cause : err;
}

function driverMessage(err: unknown): string {
  const e = originalError(err);
  return e instanceof Error ? e.message : String(e);
}

/** A client that can LISTEN: a postgres.js `Sql` or a PGlite instance. */
export interface ListenClient {
  // biome-ignore lint/suspicious/noExplicitAny: the two drivers declare different signatures.
  listen(channel: string, onPayload: (payload: string) => void): Promise<any>;
}

/** The client under a drizzle database, if it can LISTEN (a drizzle transaction cannot). */
export function listenClientOf(db: Database): ListenClient | undefined {
  const client = (db as { $client?: unknown }).$client;
  return isListenClient(client) ? client : undefined;
}

/** True for a postgres.js `Sql` or a PGlite instance (anything with a `listen` method). */
export function isListenClient(value: unknown): value is ListenClient {
  return (
    (typeof value === 'function' || (typeof value === 'object' && value !== null)) &&
    typeof (value as { listen?: unknown }).listen === 'function'
  );
}

/**
 * LISTENs on `channel` and returns the function that stops listening.
 * postgres.js resolves to `{ unlisten }` (on a connection of its own, which
 * it keeps until the client ends), PGlite to the unsubscribe function itself.
 */
export async function listen(
  client: ListenClient,
  channel: string,
  onPayload: (payload: string) => void,
): Promise<() => Promise<void>> {
  let result: unknown;
  try {
    result = await client.listen(channel, (payload) => onPayload(String(payload)));
  } catch (err) {
    throw translateError(err);
  }
  if (typeof result === 'function') return async () => void (await result());
  const unlisten = (result as { unlisten?: unknown } | null)?.unlisten;
  if (typeof unlisten === 'function') return async () => void (await unlisten.call(result));
  throw new PalisadeError('driver', 'unrecognised result from the driver’s listen()');
}
