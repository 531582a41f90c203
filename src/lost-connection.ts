/**
 * Transactions whose connection the server closed: the process must live on
 * (README, "When the connection closes inside a transaction", says what a
 * caller sees and why). postgres.js 3.4.9 ends the process when a statement
 * is sent on a transaction's connection after the server closed it — the
 * driver sends its own `ROLLBACK`, `ROLLBACK TO` or `COMMIT` as soon as a
 * function settles — so once the connection is gone nothing more is sent on
 * it, and the functions palisade gave the driver never settle. node-postgres
 * emits `error` on a checked-out client that nobody listens to, so palisade
 * listens while its transaction holds the client (pg-transaction.ts). The
 * same proxies see the transaction's statements for one more purpose: a
 * transaction a caught failure aborted must not pass for committed
 * (aborted-transaction.ts).
 */
import { assertNotAborted, nextTurn, rejected, Statements, watch } from './aborted-transaction.js';
import { afterCommitSent } from './commit-outcome.js';
import { DatabaseError } from './errors.js';
import { closedBy } from './server-error.js';

/** @internal A transaction's connection, as the guards of both drivers see it (pg-transaction.ts too). */
export interface Connection {
  lost: boolean;
  /** postgres.js: the function and palisade's checks are done; what remains is the driver's COMMIT. */
  committing?: boolean;
  /** node-postgres: the transaction's function settled; only the driver's COMMIT or ROLLBACK goes out. */
  ended?: boolean;
  /** Set when palisade refuses further statements on a live connection (its lease was lost): each rejects with it. */
  refused?: Error;
  /** Sends `ROLLBACK AND CHAIN` on the connection, past the refusal (see {@link refuseStatements}). */
  rollback?: () => void;
  /** postgres.js: the statements sent through the guarded clients, watched for a failure (aborted-transaction.ts). */
  statements?: Statements;
  /** postgres.js: the savepoints opened through the guarded clients that have not settled yet. */
  savepoints?: Set<DriverQuery>;
  /** node-postgres: whether the session may still be in the transaction once the driver is done with it. */
  open?: () => boolean;
  /** node-postgres: the first failure of a statement of the transaction that no answer of the server's explains. */
  gaveUp?: unknown;
}

/** The part of a postgres.js query palisade settles itself once its connection is lost. */
interface DriverQuery {
  executed: boolean;
  reject(err: unknown): void;
}

/** The part of a postgres.js transaction's (or savepoint's) `sql` that drizzle and palisade call. */
interface ScopedSql {
  unsafe(...args: unknown[]): unknown;
  savepoint(...args: unknown[]): Promise<unknown>;
}

// Settles never. A fresh one each time: what waits on it is collected with it (one shared promise
// would keep every abandoned transaction's continuation reachable).
const never = () => new Promise<never>(() => {});

/** @internal Guarded clients, each with the connection it runs on (a transaction's savepoints share its entry). */
export const connections = new WeakMap<object, Connection>();

// What `unsafe` returns in place of a postgres.js query once the connection is lost (or its statements
// refused): it rejects however it is read.
function refusedQuery(error: Error): Promise<never> {
  const reject = () => rejected(error);
  return Object.assign(reject(), { values: reject, raw: reject, execute: reject, describe: reject });
}

// Why a statement on `connection` is not sent, if it is not.
const refusal = (connection: Connection): Error | undefined =>
  connection.lost ? DatabaseError.connectionClosed() : (connection.refused ?? connection.statements?.refusal());

/** `client` with every statement refused, before it is sent, once `connection` is lost or refused. */
function guarded(client: ScopedSql, connection: Connection): ScopedSql {
  if (connections.has(client)) return client;
  const unsafe = (...args: unknown[]) => {
    const refused = refusal(connection);
    return refused ? refusedQuery(refused) : sent(connection, client.unsafe(...args));
  };
  const savepoint = (...args: unknown[]) => {
    const refused = refusal(connection);
    if (refused) return rejected(refused);
    // A savepoint's function gets an `sql` of its own: guarded too (drizzle's nested transactions,
    // palisade's). Once the connection is lost, postgres.js would answer the function's settling with
    // `ROLLBACK TO` (even a success, when a statement in it failed): so the function never settles, and
    // the call rejects here instead.
    const fn = args.pop() as (sql: ScopedSql) => Promise<unknown>;
    let rejectCall: (err: unknown) => void = () => {};
    const call = new Promise((resolve, reject) => {
      rejectCall = reject;
      const run = async (sql: ScopedSql) => {
        const value = await unlessLost(() => fn(guarded(sql, connection)), connection);
        if (value !== LOST) return value;
        reject(DatabaseError.connectionClosed());
        return never();
      };
      // The SAVEPOINT statement is postgres.js's own, not one `sent` sees: its failure, when it says the
      // session ended, is how the close is heard — before the caller's reaction, whose failure would
      // otherwise make postgres.js send ROLLBACK on the dying connection (its bytes then stay in the
      // connection's buffer and go out ahead of the next connect's startup, which then never completes).
      client.savepoint(...args, run).then(resolve, (err: unknown) => {
        if (!connection.lost && closedBy(err)) lose(connection);
        reject(err);
      });
    });
    // Its SAVEPOINT statement, which postgres.js sends itself, may wait in the transaction's queue too.
    const { savepoints } = connection;
    if (savepoints) {
      const pending = { executed: true, reject: rejectCall };
      savepoints.add(pending);
      const settled = () => savepoints.delete(pending);
      call.then(settled, settled);
    }
    return call;
  };
  const proxy = new Proxy(client, {
    get: (target, key) => (key === 'unsafe' ? unsafe : key === 'savepoint' ? savepoint : Reflect.get(target, key)),
    apply: (target, self, args) => {
      const refused = refusal(connection);
      return refused ? refusedQuery(refused) : sent(connection, Reflect.apply(target as never, self, args));
    },
  });
  connections.set(proxy, connection);
  if (connection.statements) watch(proxy, connection.statements);
  return proxy;
}

function sent<S>(connection: Connection, statement: S): S {
  if (!connection.statements) return statement;
  connection.statements.sent(statement);
  // The first failure that says the session ended is how the close is heard first: before the reaction of
  // whoever awaits the statement (registered after this one), which may send another — postgres.js would
  // send that one on the closed connection, and end the process. Promise's own `then`: a postgres.js
  // query's would send the statement.
  Promise.prototype.then.call(statement, undefined, (err: unknown) => {
    if (!connection.lost && closedBy(err)) lose(connection);
  });
  return statement;
}

/** The connection is lost: nothing more is sent on it, and what waits on it is rejected. */
function lose(connection: Connection): void {
  connection.lost = true;
  rejectUnsettled(connection);
}

/**
 * The connection is lost: every statement sent on it that has not settled is rejected now. postgres.js
 * answers the ones on the connection itself, but not one that waits in the transaction's own queue for
 * the connection to be free (behind a statement in flight, or one postgres.js has described first):
 * that one would never settle, nor would the palisade call or function that awaits it.
 */
function rejectUnsettled(connection: Connection): void {
  const queries = [...(connection.statements?.unsettled() ?? []), ...(connection.savepoints ?? [])];
  for (const query of queries as unknown as Partial<DriverQuery>[]) {
    if (typeof query.reject !== 'function') continue;
    // Marked as sent, so that awaiting it later does not send it on the closed connection.
    query.executed = true;
    query.reject(DatabaseError.connectionClosed());
  }
}

// In place of a transaction's or savepoint's outcome once the connection is lost.
const LOST = Symbol('the connection was lost');

/** `run()`'s outcome, or {@link LOST} in its place once the connection is lost. */
async function unlessLost<T>(run: () => Promise<T>, connection: Connection): Promise<T | typeof LOST> {
  try {
    const value = await run();
    return connection.lost ? LOST : value;
  } catch (err) {
    // The close may be what made `run` throw (or came beside it), its news not heard yet: wait a turn.
    if (!connection.lost) await nextTurn();
    if (connection.lost) return LOST;
    throw err;
  }
}

/**
 * Runs the driver's transaction call `begin(callback)` so that nothing more
 * is sent once the connection closed under it. `parent`: the `sql` client
 * of `db` (a guarded one when `db` is a transaction palisade began).
 * `sessionOf` gives the drizzle session of the transaction object the
 * driver passes to the callback, whose client is guarded before `fn` runs.
 */
export function guardedTransaction<Tx, T>(
  parent: unknown,
  begin: (callback: (tx: Tx) => Promise<T>) => Promise<T>,
  sessionOf: (tx: Tx) => { client: unknown },
  fn: (tx: Tx) => Promise<T>,
): Promise<T> {
  // A savepoint of a transaction palisade began: the driver opens it through the guarded client's
  // `savepoint`, which guards the savepoint's client and ends it safely.
  if (connections.has(parent as object)) return begin(fn);
  const connection: Connection = { lost: false, statements: new Statements(), savepoints: new Set() };
  let pending = false;
  const run = begin(async (tx) => {
    pending = true;
    const session = sessionOf(tx);
    const client = session.client as ScopedSql;
    // A postgres.js query runs once it is awaited.
    const send = (text: string) => client.unsafe(text) as PromiseLike<unknown>;
    // A turn later: a lease lost to a reset of its own connection (advisory) may come before this one's.
    connection.rollback = () =>
      nextTurn().then(() => pending && !connection.lost && send(ROLLBACK_AND_CHAIN).then(undefined, () => {}));
    session.client = guarded(client, connection);
    try {
      const value = await unlessLost(async () => {
        const value = await fn(tx).catch((err: unknown) => {
          connection.statements?.end();
          throw err;
        });
        // postgres.js would COMMIT a transaction aborted by a statement that failed after `fn` returned,
        // or in a savepoint nothing rolled back to (aborted-transaction.ts). Asked past the guards, but
        // not on a session found gone meanwhile: sent there, postgres.js would end the process.
        const failures = await (connection.statements as Statements).settled();
        if (connection.refused || !failures.aborting) return value;
        // A session the server is ending (57P01…) or a link's failure (08): asked, the probe could go out on
        // a closed connection. Taken as aborted instead (a savepoint rolled back after one is rolled back too).
        if (failures.ending) throw failures.error();
        await nextTurn();
        if (!connection.lost) await assertNotAborted(failures, () => send('select 1'));
        return value;
      }, connection);
      // Whichever way it settled, postgres.js would send COMMIT or ROLLBACK: it does not settle.
      if (value === LOST) return never();
      connection.committing = true;
      return value;
    } finally {
      pending = false;
    }
  });
  // postgres.js races the outermost transaction's function with its connection's close: settled while the
  // function still runs, it was the close. The call then rejects a turn later (nextTurn), once every connection
  // reset in the same turn is heard closed: a caller that retries at once gets one that reconnects.
  return run.catch(async (err: unknown) => {
    if (connection.committing) afterCommitSent(err);
    if (pending && !connection.lost) lose(connection);
    if (connection.lost) await nextTurn();
    throw err;
  });
}

/**
 * @internal Refuses, from now on, every statement sent on the transaction
 * whose drizzle session client is `client` (its savepoints' too), before it
 * is sent: each rejects with `reason`. And rolls it back at once (postgres.js:
 * a turn later), after the statement it runs, if any (`ROLLBACK AND CHAIN`:
 * the driver's own rollback still goes out, and ends the empty transaction
 * that follows); not where the connection was found closed.
 * False when `client` is not one palisade began a transaction on.
 */
export function refuseStatements(client: unknown, reason: Error): boolean {
  const connection = connections.get(client as object);
  if (connection === undefined) return false;
  if (connection.refused === undefined) {
    connection.refused = reason;
    if (!connection.lost) connection.rollback?.();
  }
  return true;
}

// Ends the transaction at once (its locks go: a function that goes on, idle or catching its errors in a
// savepoint, must not keep them), in place of one that holds nothing: the driver's own rollback, sent
// when the function settles, then ends that one quietly (a plain ROLLBACK with no transaction warns).
/** @internal */
export const ROLLBACK_AND_CHAIN = 'rollback and chain';
