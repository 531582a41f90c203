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
import { entityKind, is, type SQL } from 'drizzle-orm';
import {
  type PgDatabase,
  type PgDialect,
  type PgQueryResultHKT,
  type PgSession,
  PgTransaction,
} from 'drizzle-orm/pg-core';
import { causeOf, watchedPgliteTransaction, withCause } from './aborted-transaction.js';
import { failedAtCommit } from './commit-outcome.js';
import { DatabaseError, DriverError, InvalidArgumentError, PalisadeError, RetryableWriteError } from './errors.js';
import { guardedTransaction, refuseStatements as refuseOn } from './lost-connection.js';
import { assertMaySend, opening } from './overlap.js';
import { abandonTransaction, type EventClient, heardTransaction } from './pg-transaction.js';
import { heardCheckout } from './pool-checkout.js';
import { describeServerError, originalError, sessionEnded, sqlStateOf } from './server-error.js';

/** A drizzle Postgres database or transaction (postgres-js, node-postgres or PGlite). */
// biome-ignore lint/suspicious/noExplicitAny: any schema, any driver result — narrowed in this module.
export type Database = PgDatabase<PgQueryResultHKT, any, any>;

/** A result row keyed by database column name, values as the driver returns them. */
export type RawRow = Record<string, unknown>;

export interface Internals {
  session: PgSession;
  dialect: PgDialect;
}

// drizzle keeps these public on the instance but not in its declared types.
/** @internal drizzle's session and dialect of `db`. */
export function internals(db: Database): Internals {
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

/** Whether `db` is a drizzle transaction (or savepoint) rather than a database. */
export function isTransaction(db: unknown): boolean {
  return db !== null && typeof db === 'object' && is(db, PgTransaction);
}

/**
 * Runs `query` once. Values are sent as parameters; the statement is not
 * cached on our side (postgres.js still prepares it by text).
 */
export async function execute(db: Database, query: SQL): Promise<RawRow[]> {
  assertMaySend(db);
  try {
    return rowsOf(await db.execute(query));
  } catch (err) {
    throw translateError(err);
  }
}

/**
 * Runs `fn` in a transaction (a savepoint when `db` already is one; refused
 * with {@link InvalidArgumentError} while another of palisade's is open on it,
 * and after `db` ended). Calls through `fn`'s transaction after it ended are
 * refused too.
 */
export async function transaction<T>(db: Database, fn: (tx: Database) => Promise<T>): Promise<T> {
  const use = opening(db, isTransaction(db));
  try {
    return await new Promise<T>((resolve, reject) => {
      inTransaction(db, (tx) => {
        use.opened(tx);
        return fn(tx).then(
          (value) => {
            if (!use.orphaned()) {
              use.ended(tx, false);
              return value;
            }
            reject(new InvalidArgumentError(ORPHANED));
            return unsettled(tx);
          },
          (err: unknown) => {
            use.ended(tx, true);
            if (!use.orphaned()) throw err;
            reject(err instanceof CallerThrew ? err : translateError(err));
            return unsettled(tx);
          },
        );
      }).then(resolve, reject);
    });
  } finally {
    use.closed();
  }
}

const ORPHANED =
  'a call started inside the function of a transaction palisade opened was still running when that ended: it rolled back with it, and nothing it wrote is kept';

// What a savepoint's function gives the driver once the savepoint went with its parent (overlap.ts,
// `orphaned`): settling it would make the driver send a RELEASE or ROLLBACK TO. What waits on it is
// collected with it; what waits for the driver to finish it is let go.
const unsettled = (tx: Database) => {
  abandonTransaction(tx);
  return new Promise<never>(() => {});
};

async function inTransaction<T>(db: Database, fn: (tx: Database) => Promise<T>): Promise<T> {
  try {
    // A connection the server closes inside the transaction must not end the process: see lost-connection.ts.
    const sessionOf = (d: Database) => internals(d).session as unknown as { client: unknown };
    const driver = driverOf(db);
    // node-postgres: a pool's client is heard from its checkout on (pool-checkout.ts).
    const begin = (callback: (tx: Database) => Promise<T>) =>
      driver === 'node-postgres' && !isTransaction(db)
        ? heardCheckout(internals(db).session as never, (tx: Database) => withCause(tx, callback))
        : db.transaction((tx) => withCause(tx as unknown as Database, callback));
    if (driver === 'postgres-js') return await guardedTransaction(sessionOf(db).client, begin, sessionOf, fn);
    if (driver === 'node-postgres')
      return await heardTransaction(begin, sessionOf, fn, sessionOf(db), isTransaction(db));
    return isTransaction(db) ? await begin(fn) : await watchedPgliteTransaction(begin, sessionOf, fn);
  } catch (err) {
    // A savepoint's release that found the transaction aborted (25P02): why it was aborted, as inside it.
    if (err instanceof CallerThrew) throw err;
    // The outermost transaction's COMMIT was on its way and the server gave no answer that says it failed — the
    // session ended, or the failure is the client's own (a socket error, node-postgres's query_timeout, which
    // leaves the COMMIT running): committed or not, nobody knows.
    const unknown = !isTransaction(db) && failedAtCommit(err) && (sessionEnded(err) || sqlStateOf(err) === undefined);
    throw translateError(await causeOf((internals(db).session as unknown as { client: unknown }).client, err), unknown);
  }
}

/**
 * @internal Refuses every statement sent on `tx` from now on, before it is
 * sent (the driver's own rollback still goes out): each rejects with
 * `reason`; and rolls the transaction back after the statement it runs.
 * For a transaction palisade began on postgres.js or node-postgres; false,
 * and nothing done, otherwise.
 */
export function refuseStatements(tx: Database, reason: Error): boolean {
  return refuseOn((internals(tx).session as unknown as { client: unknown }).client, reason);
}

// What the caller's own code threw inside palisade's transactions, boxed so that it passes through
// each of them (nested ones too) untranslated, and comes out where palisade returns to the caller.
class CallerThrew {
  constructor(readonly error: unknown) {}
}

/**
 * @internal Runs the caller's own code (a `modify` function, a fenced
 * transaction's function) inside palisade's transactions: what it throws
 * rolls them back and passes through {@link transaction} untranslated, until
 * {@link asThrown} gives it back as it was thrown.
 */
export async function callerCode<T>(fn: () => T | Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (error) {
    throw new CallerThrew(error);
  }
}

/** @internal Where palisade returns to the caller: the caller's own error as it was thrown; any other as it is. */
export function asThrown(err: unknown): unknown {
  return err instanceof CallerThrew ? err.error : err;
}

/** How many rows a statement wrote: postgres.js `count`, node-postgres `rowCount`, PGlite `affectedRows`. */
export function affectedOf(result: unknown): number {
  const r = result as { count?: unknown; rowCount?: unknown; affectedRows?: unknown } | null;
  const n = r?.count ?? r?.rowCount ?? r?.affectedRows;
  if (typeof n === 'number') return n;
  throw new DriverError('unrecognised result shape from the database driver');
}

/** The result rows, whichever driver returned them. */
export function rowsOf(result: unknown): RawRow[] {
  if (Array.isArray(result)) return result as RawRow[];
  const rows = (result as { rows?: unknown } | null)?.rows;
  if (Array.isArray(rows)) return rows as RawRow[];
  throw new DriverError('unrecognised result shape from the database driver');
}

/** Reads an int8 as the drivers return it (string, number or bigint). `null` stays `null`. */
export function int8(value: unknown): bigint | null {
  if (value === null || value === undefined) return null;
  if (typeof value === 'bigint') return value;
  if (typeof value === 'number' || typeof value === 'string') return BigInt(value);
  throw new DriverError(`expected an int8, got ${typeof value}`);
}

/** Reads a Postgres `count(*)` or other int8 that cannot be null. */
export function count(value: unknown): number {
  return Number(int8(value) ?? 0n);
}

/**
 * Maps a driver error to palisade's: our own errors pass through, 40001 and
 * 40P01 become {@link RetryableWriteError}, the rest {@link DatabaseError}.
 * Neither keeps the driver's error (drizzle's wrapper lists the query
 * parameters; the server's text and DETAIL may quote values): their message
 * and `cause` carry SQLSTATE, table, column and constraint only — see
 * {@link DatabaseError}.
 */
export function translateError(err: unknown, outcomeUnknown = false): Error {
  if (err instanceof PalisadeError) return err;
  // palisade's own, under drizzle's wrapper (a statement src/lost-connection.ts refused to send).
  const original = originalError(err);
  if (original instanceof PalisadeError) return original;
  const state = sqlStateOf(err);
  if (state === '40001' || state === '40P01') {
    return new RetryableWriteError(
      state === '40001' ? 'serialization_failure' : 'deadlock',
      describeServerError(err, state).error,
    );
  }
  return new DatabaseError(state, err, outcomeUnknown);
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
      const quoted = `"${channel.replaceAll('"', '""')}"`;
      const onNotification = (message: { channel: string; payload?: string }) => {
        if (message.channel === channel) onPayload(message.payload ?? '');
      };
      let current: { connection: ListeningClient; release: () => void } | undefined;
      let stopped = false;
      let retry: ReturnType<typeof setTimeout> | undefined;
      const open = async () => {
        const connection = (isPool ? await (client as NodePostgresClient).connect() : client) as ListeningClient;
        let released = false;
        const release = () => {
          connection.removeListener('notification', onNotification);
          if (current?.connection === connection) current = undefined;
          if (released) return;
          released = true;
          connection.release?.(true); // a second release of a pool's client throws
        };
        connection.on('notification', onNotification);
        // The server closed it (a restart, pg_terminate_backend, a failover): on a client checked out
        // of a pool an unheard 'error' ends the process. Notifications are hints: until a new LISTEN is
        // open, waits fall back to their timeouts. (A client of the caller's own is the caller's to hear.)
        if (isPool) {
          connection.on('error', () => {
            release();
            if (!stopped) again();
          });
        }
        try {
          await connection.query(`listen ${quoted}`);
        } catch (err) {
          release();
          throw err;
        }
        if (stopped) release();
        else current = { connection, release };
      };
      const again = () => {
        clearTimeout(retry);
        retry = setTimeout(() => open().catch(again), RELISTEN_MS);
        retry.unref?.();
      };
      await open();
      return async () => {
        stopped = true;
        clearTimeout(retry);
        const open = current;
        if (!open) return;
        open.connection.removeListener('notification', onNotification);
        try {
          await open.connection.query(`unlisten ${quoted}`);
        } finally {
          open.release();
        }
      };
    },
  };
}

/** How long a node-postgres LISTEN whose connection was lost waits before it opens a new one. */
const RELISTEN_MS = 1_000;

type ListeningClient = NodePostgresClient & EventClient & { release?: (destroy?: boolean) => void };

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
  throw new DriverError('unrecognised result from the driver’s listen()');
}
