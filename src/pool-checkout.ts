/**
 * node-postgres: a transaction's client, checked out of a pool, heard from
 * its checkout on (README, "When the connection closes inside a
 * transaction"; the rest of that is lost-connection.ts).
 */
import { DriverError } from './errors.js';
import type { EventClient } from './pg-transaction.js';

// Heard, and nothing more to do: a client whose BEGIN failed is given back as broken.
const heard = () => {};

/** A node-postgres pool as drizzle's session holds it: what a transaction checks a client out of. */
interface PoolLike {
  connect(callback: (err: Error | undefined, client: PooledClient | undefined) => void): void;
}
type PooledClient = EventClient & { release(err?: Error): void };

/** @internal drizzle's own test for a pool (its node-postgres session's `transaction`). */
export const isPool = (client: unknown): client is PoolLike =>
  typeof (client as { connect?: unknown } | null)?.connect === 'function' &&
  Object.getPrototypeOf(client)?.constructor?.name?.includes('Pool') === true;

/**
 * node-postgres: drizzle's `session.transaction(callback)`, with the client it checks out of a pool heard
 * from the checkout on. drizzle sends BEGIN before its `try`: a BEGIN that fails (the pooled session was
 * ended just then) leaves the client checked out for good and its `error` unheard — the event would end
 * the process, and the pool would lend one connection less. Here the client is heard from the start, and
 * given back as broken (the pool discards it) when the callback never ran.
 */
export function heardCheckout<T>(
  session: { client: unknown; transaction(callback: (tx: never) => Promise<T>): Promise<T> },
  callback: (tx: never) => Promise<T>,
): Promise<T> {
  const pool = session.client;
  if (!isPool(pool)) return session.transaction(callback);
  let client: PooledClient | undefined;
  let entered = false;
  // The callback form: the pool calls it in the same run as it lends the client (and stops listening to it
  // itself). The promise form's answer comes a microtask later, and a FATAL read with the client's last
  // answer is emitted in between (an attack saw 17 in 400 checkouts under kills).
  const connect = () =>
    new Promise<PooledClient>((resolve, reject) => {
      pool.connect((err, lent) => {
        if (err || !lent) return reject(err);
        lent.on('error', heard);
        client = lent;
        resolve(lent);
      });
    });
  const heardPool = new Proxy(pool, { get: (target, key) => (key === 'connect' ? connect : Reflect.get(target, key)) });
  // The session as it is, but for the pool it checks out of.
  const own = Object.create(session, { client: { value: heardPool } }) as typeof session;
  return own
    .transaction((tx) => {
      entered = true;
      return callback(tx);
    })
    .then(
      (value) => {
        client?.removeListener('error', heard);
        return value;
      },
      (err: unknown) => {
        // drizzle released the client once the callback ran; before that (BEGIN failed), nothing did.
        if (entered) client?.removeListener('error', heard);
        else client?.release(err instanceof Error ? err : new DriverError('BEGIN failed'));
        throw err;
      },
    );
}
