/**
 * node-postgres's side of "When the connection closes inside a transaction"
 * (README): a transaction palisade began holds its client heard, its
 * statements refusable, and — once the driver is done with it — gives it
 * back only out of the transaction. The rest is lost-connection.ts.
 */
import { commitAnswer, sentAfterEnd, unwatch, watch } from './aborted-transaction.js';
import { afterCommitSent } from './commit-outcome.js';
import { DriverError } from './errors.js';
import { type Connection, connections, ROLLBACK_AND_CHAIN } from './lost-connection.js';
import { type PgClientState, queryable, refusedStatement, whenIdle } from './node-postgres-client.js';
import { isPool } from './pool-checkout.js';
import { sqlStateOf } from './server-error.js';

/** The part of a node-postgres client that emits its connection's errors. */
export interface EventClient {
  on(event: 'error', listener: (err: unknown) => void): unknown;
  removeListener(event: 'error', listener: (err: unknown) => void): unknown;
}

// Heard, and nothing more to do: the statements that follow on the client reject (it is not queryable).
const heard = () => {};

/** The part of a node-postgres client drizzle sends statements through. */
interface QueryClient extends EventClient {
  query(...args: unknown[]): unknown;
}

const textOf = (query: unknown): string | undefined => {
  const text = typeof query === 'string' ? query : (query as { text?: unknown } | null)?.text;
  return typeof text === 'string' ? text.trim() : undefined;
};
// drizzle's own rollbacks (of the transaction, to a savepoint) end a refused transaction: never refused.
const isRollback = (query: unknown): boolean => /^rollback( to savepoint \w+)?$/i.test(textOf(query) ?? '');
// What drizzle sends once the transaction's function settled.
const isEnd = (query: unknown): boolean => /^(commit|rollback)$/i.test(textOf(query) ?? '');

/**
 * A node-postgres `client` whose statements (but a rollback) are refused, before they are sent, once
 * `connection` is refused — each answered with the refusal as the client answers on a connection it cannot
 * query ({@link refusedStatement}). From then on what still goes out — `ROLLBACK AND CHAIN`, then the driver's
 * rollbacks — goes once the client is idle ({@link whenIdle}). Until then every call passes through untouched.
 */
function refusing(client: QueryClient & { release?(err?: Error): void }, connection: Connection): QueryClient {
  const state = client as unknown as PgClientState;
  const query = (...args: unknown[]) => {
    // Sent after the function settled (by a call it left running): it would run after the COMMIT or
    // ROLLBACK, outside the transaction, on a client the pool lends to someone else next.
    if (connection.ended && !isEnd(args[0])) return refusedStatement(state, args, sentAfterEnd());
    if (!connection.refused) return noting(client.query(...args), connection);
    if (!isRollback(args[0])) return refusedStatement(state, args, connection.refused);
    return whenIdle(state, () => client.query(...args));
  };
  connection.rollback = () =>
    whenIdle(state, () => client.query(ROLLBACK_AND_CHAIN) as PromiseLike<unknown>).then(undefined, () => {});
  // A pool's client whose session is still in the transaction (the driver gave up on its last statements) goes
  // back broken — the pool closes it, and the server rolls the transaction back — not to the next borrower,
  // whose statements would run in it: its COMMIT would keep this one's writes, or its end take theirs.
  const release = (err?: Error) =>
    client.release?.(err ?? (connection.open?.() ? new DriverError(STILL_OPEN) : undefined));
  const proxy = new Proxy(client, {
    get: (target, key) => (key === 'query' ? query : key === 'release' ? release : Reflect.get(target, key)),
  });
  connections.set(proxy, connection);
  return proxy;
}

const STILL_OPEN =
  'the driver gave up on the transaction before the server ended it (query_timeout): its connection is closed';
const GAVE_UP =
  'the client gave up on a statement of the transaction (query_timeout) that the server may still run: rolled back, nothing it wrote is kept';

// Notes a statement of the transaction that failed with no answer of the server's (the client gave up, or the link
// went): its write may still be running there, and a COMMIT after it would keep it — whatever the caller was told.
function noting<R>(result: R, connection: Connection): R {
  if (result !== null && typeof (result as { then?: unknown })?.then === 'function') {
    (result as unknown as Promise<unknown>).then(undefined, (err: unknown) => {
      if (sqlStateOf(err) === undefined) connection.gaveUp ??= err;
    });
  }
  return result;
}

/**
 * A single client's `query`, noting statements the client gave up on, until the returned function puts it back: on
 * a single client drizzle runs the transaction on the database's own client, which palisade's prepared statements
 * keep for good, so it is not wrapped in a proxy.
 */
function notingSingle(client: QueryClient, connection: Connection): () => void {
  const own = Object.hasOwn(client, 'query');
  const before = client.query;
  client.query = (...args: unknown[]) => noting(before.apply(client, args), connection);
  return () => {
    if (own) client.query = before;
    else delete (client as Partial<QueryClient>).query;
  };
}

/**
 * node-postgres: runs the driver's transaction call `begin(callback)` with
 * an `error` listener on the transaction's client until the driver is done
 * with it, and its statements refusable ({@link refuseStatements}).
 * `sessionOf` gives the drizzle session (its client) of the transaction
 * object the driver passes to the callback.
 */
export function heardTransaction<Tx, T>(
  begin: (callback: (tx: Tx) => Promise<T>) => Promise<T>,
  sessionOf: (tx: Tx) => { client: unknown },
  fn: (tx: Tx) => Promise<T>,
  parent: { client: unknown },
  nested: boolean,
): Promise<T> {
  let client: EventClient | undefined;
  const connection: Connection = { lost: false };
  const off = () => client?.removeListener('error', heard);
  let answer: ReturnType<typeof commitAnswer> | undefined;
  let watched: object | undefined;
  // drizzle runs the transaction on `parent` itself: a single client, not one of a pool.
  let single = false;
  let entered = false;
  let unnote = () => {};
  // Heard until the driver is done with the client, rollback included: a session ended while a
  // statement ran (pg_terminate_backend) fails that statement first and closes the socket after, and
  // the close comes as an event once no query is left to take it.
  return begin((tx) => {
    entered = true;
    const session = sessionOf(tx);
    // A savepoint of a transaction palisade began: its client is heard and refusable already.
    if (!connections.has(session.client as object)) {
      client = session.client as QueryClient;
      client.on('error', heard);
      // The COMMIT's answer, read from the connection (not in the caller's own transaction: its COMMIT is theirs).
      const heardAnswer = nested ? undefined : commitAnswer(client);
      answer = heardAnswer;
      if (heardAnswer) connection.open = () => heardAnswer.open();
      // On a single client (not a pool) drizzle runs the transaction on the database's own session
      // (`parent`), whose client the statements palisade prepares there keep for good: not refusable.
      if (session !== parent) session.client = refusing(client as QueryClient, connection);
      else if (!nested) {
        single = true;
        unnote = notingSingle(client as QueryClient, connection);
      }
      if (heardAnswer) {
        watched = session.client as object;
        watch(watched, heardAnswer.failures);
      }
    }
    abandoning.set(tx as object, off);
    // A transaction palisade began: once its function settled, nothing but the driver's COMMIT or
    // ROLLBACK goes out. (A savepoint of yours shares your transaction's session, and its client: not there.)
    if (nested) return fn(tx);
    return fn(tx)
      .then((value) => {
        // A statement the client gave up on (the function caught its failure) may still write: no COMMIT after it.
        if (connection.gaveUp !== undefined) throw new DriverError(GAVE_UP);
        // drizzle sends the COMMIT next (into a connection the client knows closed, it changes nothing).
        connection.committing = !connection.lost && queryable(client);
        return value;
      })
      .finally(() => {
        connection.ended = true;
      });
  })
    .catch((err: unknown) => {
      if (connection.committing) afterCommitSent(err);
      // A single client whose BEGIN got no answer (drizzle sends it before the function runs): the server may yet
      // run it, and the client's next statements with it — ended, as a pool gives such a client back broken.
      if (!entered && !nested && !isPool(parent.client) && sqlStateOf(err) === undefined) endSingle(parent.client);
      throw err;
    })
    .then((value) => {
      answer?.check();
      return value;
    })
    .finally(() => {
      unnote();
      // A single client whose session is still in the transaction cannot go back to a pool: it is ended (the server
      // rolls the transaction back) rather than left to run its next statements in it.
      if (single && connection.open?.()) endSingle(client);
      off();
      if (watched) unwatch(watched);
      answer?.off();
    });
}

// Ends a single node-postgres client, heard until it is.
function endSingle(client: unknown): void {
  const c = client as EventClient & { end?: () => Promise<void> };
  if (typeof c.end !== 'function') return;
  c.on('error', heard);
  void c.end().then(
    () => c.removeListener('error', heard),
    () => c.removeListener('error', heard),
  );
}

// What to undo for each transaction or savepoint heardTransaction runs, should the driver never finish it.
const abandoning = new WeakMap<object, () => void>();

/**
 * @internal node-postgres: the driver will never finish `tx` (a savepoint whose function palisade leaves
 * unsettled, driver.ts): its client is no longer listened to for it — a pool lends that client on, and
 * a listener per such savepoint would stay on it for good.
 */
export function abandonTransaction(tx: unknown): void {
  abandoning.get(tx as object)?.();
}
