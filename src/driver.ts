/**
 * The one place that knows how drizzle's Postgres drivers differ.
 *
 * palisade runs on drizzle's `postgres-js`, `node-postgres` and `pglite`
 * drivers (and inside their transactions). They differ in what `execute`
 * returns (an array vs `{ rows }`), how int8 comes back (string vs
 * number/bigint), how errors are wrapped and what a statement name means
 * (node-postgres sends it to the server as the prepared statement's name,
 * which Postgres truncates to 63 bytes). Everything above this module sees
 * plain row objects, bigints and {@link PalisadeError}s.
 */
import { createHash } from 'node:crypto';
import { entityKind, type SQL } from 'drizzle-orm';
import type { PgDatabase, PgDialect, PgPreparedQuery, PgQueryResultHKT, PgSession } from 'drizzle-orm/pg-core';
import { InvalidArgumentError, PalisadeError, RetryableWriteError } from './errors.js';

/** A drizzle Postgres database or transaction (postgres-js, node-postgres or PGlite). */
// biome-ignore lint/suspicious/noExplicitAny: any schema, any driver result — narrowed in this module.
export type Database = PgDatabase<PgQueryResultHKT, any, any>;

/** A result row keyed by database column name, values as the driver returns them. */
export type RawRow = Record<string, unknown>;

/**
 * The database refused a statement for a reason palisade does not interpret.
 *
 * What the message says, and what it never says: it keeps the SQLSTATE, its
 * condition name, and the schema, table, column and constraint the server
 * names in its error fields. It never carries a value: the server's own text
 * quotes values for data errors (`invalid input syntax for type integer:
 * "…"`), its DETAIL quotes the failing row, and drizzle's error lists the
 * query's parameters. So the server's text is kept only for the classes
 * whose messages are about the statement, the schema or the server
 * ({@link SERVER_TEXT_CLASSES}), never DETAIL, HINT or WHERE; the driver's
 * error is not kept either: `cause` is a sanitised copy with the same
 * fields and nothing else (`console.log(err)` prints causes).
 */
export class DatabaseError extends PalisadeError {
  /** The schema, table, column, data type and constraint named by the server, when it names them. */
  readonly schema: string | undefined;
  readonly table: string | undefined;
  readonly column: string | undefined;
  readonly dataType: string | undefined;
  readonly constraint: string | undefined;

  constructor(
    readonly sqlState: string | undefined,
    cause: unknown,
  ) {
    const safe = sanitize(cause, sqlState);
    super('database', safe.message, { cause: safe.error });
    this.schema = safe.fields.schema;
    this.table = safe.fields.table;
    this.column = safe.fields.column;
    this.dataType = safe.fields.dataType;
    this.constraint = safe.fields.constraint;
  }
}

/**
 * SQLSTATE classes whose server messages name objects of the schema or the
 * server (never a value a statement carried): connection (08), feature not
 * supported (0A), transaction state (25, 2D), authorization (28), catalog
 * and schema names (3D, 3F), rollback (40), syntax and access rules (42:
 * identifiers and tokens of the query text — palisade sends every value as a
 * parameter), resources (53), object state and locks (55), operator
 * intervention (57), system errors (58), and palisade's fence trigger (PF:
 * table name and fences). Data exceptions (22), integrity violations (23,
 * whose DETAIL quotes the row), PL/pgSQL RAISE (P0) and internal errors (XX)
 * are described by their fields only.
 */
const SERVER_TEXT_CLASSES = new Set([
  '08',
  '0A',
  '25',
  '2D',
  '28',
  '3D',
  '3F',
  '40',
  '42',
  '53',
  '55',
  '57',
  '58',
  'PF',
]);

/** Condition names of the SQLSTATEs a palisade user meets most (the rest show the code alone). */
const CONDITIONS: Record<string, string> = {
  '22001': 'string_data_right_truncation',
  '22003': 'numeric_value_out_of_range',
  '22007': 'invalid_datetime_format',
  '22008': 'datetime_field_overflow',
  '22012': 'division_by_zero',
  '22021': 'character_not_in_repertoire',
  '22023': 'invalid_parameter_value',
  '22P02': 'invalid_text_representation',
  '22P05': 'untranslatable_character',
  '23502': 'not_null_violation',
  '23503': 'foreign_key_violation',
  '23505': 'unique_violation',
  '23514': 'check_violation',
  '23P01': 'exclusion_violation',
  '25P02': 'in_failed_sql_transaction',
  '40001': 'serialization_failure',
  '40P01': 'deadlock_detected',
  '42501': 'insufficient_privilege',
  '42601': 'syntax_error',
  '42703': 'undefined_column',
  '42804': 'datatype_mismatch',
  '42883': 'undefined_function',
  '42P01': 'undefined_table',
  '55P03': 'lock_not_available',
  '57014': 'query_canceled',
  '57P01': 'admin_shutdown',
  P0001: 'raise_exception',
};

/** Error codes (not SQLSTATEs) of a connection that failed: their messages name the server, not data. */
const CONNECTION_CODES = /^(E[A-Z]+|CONNECT_TIMEOUT|CONNECTION_[A-Z]+)$/;

interface SafeFields {
  schema?: string;
  table?: string;
  column?: string;
  dataType?: string;
  constraint?: string;
}

/** Reads one of the server's error fields as postgres.js (`table_name`) or pg-protocol (`table`: PGlite, pg) names it. */
function field(err: object, ...names: string[]): string | undefined {
  for (const name of names) {
    const value = (err as Record<string, unknown>)[name];
    if (typeof value === 'string' && value.length > 0) return value;
  }
  return undefined;
}

function sanitize(cause: unknown, sqlState: string | undefined): { message: string; error: Error; fields: SafeFields } {
  const original = originalError(cause);
  const err = original !== null && typeof original === 'object' ? original : {};
  const fields: SafeFields = {};
  const schema = field(err, 'schema_name', 'schema');
  const table = field(err, 'table_name', 'table');
  const column = field(err, 'column_name', 'column');
  const dataType = field(err, 'data_type', 'dataType');
  const constraint = field(err, 'constraint_name', 'constraint');
  if (schema) fields.schema = schema;
  if (table) fields.table = table;
  if (column) fields.column = column;
  if (dataType) fields.dataType = dataType;
  if (constraint) fields.constraint = constraint;

  const parts: string[] = [];
  if (sqlState) {
    const condition = CONDITIONS[sqlState];
    parts.push(`SQLSTATE ${sqlState}${condition ? ` ${condition}` : ''}`);
  }
  const on = [
    table ? `table ${schema ? `${schema}.` : ''}${table}` : undefined,
    column ? `column ${column}` : undefined,
    dataType ? `type ${dataType}` : undefined,
    constraint ? `constraint ${constraint}` : undefined,
  ].filter((x) => x !== undefined);
  if (on.length > 0) parts.push(on.join(', '));
  const text = original instanceof Error ? original.message : undefined;
  const code = (err as { code?: unknown }).code;
  if (text && sqlState && SERVER_TEXT_CLASSES.has(sqlState.slice(0, 2))) parts.push(text);
  else if (text && !sqlState && typeof code === 'string' && CONNECTION_CODES.test(code)) parts.push(text);
  else if (!sqlState) parts.push(`${original instanceof Error ? original.name : typeof original} from the driver`);
  const message = `database error: ${parts.join('; ')}`;

  // The cause: the same facts, as an error of the driver's class name, without its message, detail or parameters.
  const error = new Error(message);
  error.name = original instanceof Error ? original.name : 'Error';
  Object.assign(error, { ...(sqlState ? { code: sqlState } : typeof code === 'string' ? { code } : {}), ...fields });
  const severity = field(err, 'severity');
  if (severity) Object.assign(error, { severity });
  return { message, error, fields };
}

interface Internals {
  session: PgSession;
  dialect: PgDialect;
}

// drizzle keeps these public on the instance but not in its declared types.
function internals(db: Database): Internals {
  return db as unknown as Internals;
}

/** The drizzle drivers palisade supports. */
export type DriverName = 'postgres-js' | 'node-postgres' | 'pglite';

// drizzle's session classes, by their entityKind (stable across drizzle versions,
// and readable without importing the driver modules, which would load pg or PGlite).
const SESSION_KINDS: Readonly<Record<string, DriverName>> = {
  PostgresJsSession: 'postgres-js',
  NodePgSession: 'node-postgres',
  PgliteSession: 'pglite',
};

/** Which supported driver `db` runs on, or `undefined` for anything else (neon, vercel, a proxy, not a database). */
export function driverOf(db: unknown): DriverName | undefined {
  const session = (db as { session?: unknown } | null | undefined)?.session;
  if (session === null || typeof session !== 'object') return undefined;
  const kind = (session.constructor as { [entityKind]?: unknown } | undefined)?.[entityKind];
  return typeof kind === 'string' ? SESSION_KINDS[kind] : undefined;
}

/**
 * Throws {@link InvalidArgumentError} unless `db` is a drizzle database or
 * transaction on postgres-js, node-postgres or PGlite — before any query, so
 * an unsupported driver is refused up front, not discovered at a later write.
 * @param who the caller, for the message (`fencedRepository`).
 */
export function assertSupportedDriver(db: unknown, who: string): asserts db is Database {
  if (driverOf(db) !== undefined) return;
  const session = (db as { session?: { constructor?: { [entityKind]?: unknown } } } | null | undefined)?.session;
  const kind = session?.constructor?.[entityKind];
  throw new InvalidArgumentError(
    `${who} needs a drizzle database or transaction on postgres-js, node-postgres or pglite` +
      (typeof kind === 'string' ? ` (got a ${kind})` : ' (got something that is not a drizzle Postgres database)'),
  );
}

/**
 * The server-side name of a prepared statement: short (Postgres truncates
 * names to 63 bytes, so long names collide) and a function of the statement
 * itself, so two different statements never share a name and one statement
 * always gets the same one, on every connection of a pool.
 */
export function statementName(key: string, text: string): string {
  return `palisade_${createHash('sha256').update(key).update('\0').update(text).digest('hex').slice(0, 32)}`;
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
    // node-postgres sends the name to the server as is: a hash keeps it short and unique.
    const compiled = dialect.sqlToQuery(build());
    const name = key === undefined ? undefined : statementName(key, compiled.sql);
    query = session.prepareQuery(compiled, undefined, name, false) as PgPreparedQuery<never>;
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
    const known = (e as { sqlState?: unknown }).sqlState;
    if (typeof known === 'string' && /^[0-9A-Z]{5}$/.test(known)) return known;
    const code = (e as { code?: unknown }).code;
    if (typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code)) return code;
  }
  return undefined;
}

/**
 * Maps a driver error to palisade's: our own errors pass through, 40001 and
 * 40P01 become {@link RetryableWriteError}, the rest {@link DatabaseError}.
 * Neither keeps the driver's error (drizzle's wrapper lists the query
 * parameters; the server's text and DETAIL may quote values): their message
 * and `cause` carry SQLSTATE, table, column and constraint only — see
 * {@link DatabaseError}.
 */
export function translateError(err: unknown): Error {
  if (err instanceof PalisadeError) return err;
  const state = sqlStateOf(err);
  if (state === '40001' || state === '40P01') return new RetryableWriteError(state, sanitize(err, state).error);
  return new DatabaseError(state, err);
}

function originalError(err: unknown): unknown {
  const cause = (err as { cause?: unknown } | null)?.cause;
  return (err as { name?: unknown } | null)?.constructor?.name === 'DrizzleQueryError' && cause ? cause : err;
}

/** A client that can LISTEN: a postgres.js `Sql` or a PGlite instance. */
export interface ListenClient {
  // biome-ignore lint/suspicious/noExplicitAny: the two drivers declare different signatures.
  listen(channel: string, onPayload: (payload: string) => void): Promise<any>;
}

/**
 * The client under a drizzle database, if it can LISTEN (a drizzle
 * transaction cannot): postgres.js and PGlite as they are; a node-postgres
 * `Pool` or `Client` through {@link nodePostgresListener}.
 */
export function listenClientOf(db: Database): ListenClient | undefined {
  const client = (db as { $client?: unknown }).$client;
  if (driverOf(db) === 'node-postgres' && isNodePostgresClient(client)) return nodePostgresListener(client);
  return isListenClient(client) ? client : undefined;
}

/** The part of a node-postgres `Pool` or `Client` that LISTEN needs. */
interface NodePostgresClient {
  query(text: string): Promise<unknown>;
  connect(): Promise<unknown>;
  on(event: 'notification', listener: (message: { channel: string; payload?: string }) => void): unknown;
  removeListener(event: 'notification', listener: (message: { channel: string; payload?: string }) => void): unknown;
}

function isNodePostgresClient(value: unknown): value is { query: unknown; connect: unknown } {
  return (
    typeof value === 'object' &&
    value !== null &&
    typeof (value as { query?: unknown }).query === 'function' &&
    typeof (value as { connect?: unknown }).connect === 'function'
  );
}

/**
 * LISTEN for node-postgres: a `Pool` lends one connection for as long as
 * the listener lives (released, and destroyed, by the returned unlisten); a
 * `Client` listens on itself. A dropped connection silently ends the
 * notifications: waiters then wake on their backoff timers only.
 */
function nodePostgresListener(client: { query: unknown; connect: unknown }): ListenClient {
  const isPool = typeof (client as { totalCount?: unknown }).totalCount === 'number';
  return {
    async listen(channel, onPayload) {
      const connection = (isPool ? await (client as NodePostgresClient).connect() : client) as NodePostgresClient & {
        release?: (destroy?: boolean) => void;
      };
      const onNotification = (message: { channel: string; payload?: string }) => {
        if (message.channel === channel) onPayload(message.payload ?? '');
      };
      connection.on('notification', onNotification);
      const quoted = `"${channel.replaceAll('"', '""')}"`;
      try {
        await connection.query(`listen ${quoted}`);
      } catch (err) {
        connection.removeListener('notification', onNotification);
        connection.release?.(true);
        throw err;
      }
      return async () => {
        connection.removeListener('notification', onNotification);
        try {
          await connection.query(`unlisten ${quoted}`);
        } finally {
          connection.release?.(true);
        }
      };
    },
  };
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
