/**
 * What a node-postgres client does with a statement it cannot take, done
 * from outside it: answer a refused statement as the client answers one on
 * a connection it cannot query, or send one only once the client is idle.
 * lost-connection.ts refuses and ends transactions with these.
 */
import { rejected } from './aborted-transaction.js';

/** What of a node-postgres `Client` the refusal reads (its own fields, stable across pg 8). */
export interface PgClientState {
  /** Nothing runs on the client and nothing waits in its queue. */
  readonly readyForQuery?: boolean;
  readonly pipeline?: boolean;
  /** False once the connection failed; `_ending` once the client is being closed: it answers at once then. */
  readonly _queryable?: boolean;
  readonly _ending?: boolean;
  /** True once its connection ended. */
  readonly _ended?: boolean;
  readonly connection?: unknown;
  /** `Client.Query`: how the client itself turns `query(config, values, callback)` into a statement. */
  readonly constructor: { Query?: new (...args: unknown[]) => PgQuery };
  once(event: 'drain' | 'end' | 'error', listener: () => void): unknown;
  removeListener(event: 'drain' | 'end' | 'error', listener: () => void): unknown;
}
interface PgQuery {
  readonly callback?: unknown;
  handleError(err: unknown, connection: unknown): void;
}

/** Whether `client` (a node-postgres `Client`, if it is one) has not yet found its connection gone. */
export function queryable(client: unknown): boolean {
  const state = client as PgClientState | undefined;
  return state?._queryable !== false && state?._ended !== true;
}

/**
 * A refused statement answered as node-postgres answers one on a client it cannot query: a Submittable, or a
 * statement with a callback, through its `handleError` on the next tick; otherwise a rejected promise.
 */
export function refusedStatement(client: PgClientState, args: unknown[], error: Error): unknown {
  const [config, values, callback] = args;
  // What the client throws at once, queryable or not.
  if (config === null || config === undefined) throw new TypeError('Client was passed a null or undefined query');
  if (typeof (config as { submit?: unknown }).submit === 'function') {
    const submittable = config as PgQuery & { callback?: unknown };
    // As the client does: a function among the arguments is the Submittable's callback.
    const given = typeof values === 'function' ? values : callback;
    if (!submittable.callback && given) submittable.callback = given;
    process.nextTick(() => submittable.handleError(error, client.connection));
    return submittable;
  }
  const Query = client.constructor.Query;
  const query = Query ? new Query(config, values, callback) : undefined;
  if (query?.callback === undefined) return rejected(error);
  if (typeof query.callback !== 'function') throw new TypeError('callback is not a function');
  process.nextTick(() => query.handleError(error, client.connection));
  return undefined;
}

// How often a wait for the client to be idle looks at it again (see whenIdle).
const LOOK_AGAIN_MS = 250;

/**
 * @internal `send()` once nothing runs on the node-postgres client and nothing waits in its queue (its `drain`), or at
 * once where it cannot tell or the client is gone: a statement handed to a client while another waits in its
 * queue is deprecated (pg 8.x warns, pg 9 drops it), and the client's `query_timeout` would drop it unsent.
 */
export function whenIdle<T>(client: PgClientState, send: () => T): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const now = () => {
      try {
        resolve(send());
      } catch (err) {
        reject(err);
      }
    };
    const busy = () =>
      client.readyForQuery === false && !client.pipeline && client._queryable !== false && !client._ending;
    const go = () => (busy() ? wait() : now());
    const wait = () => {
      // Looked at again now and then too: a failure that left the client busy for good emits nothing more.
      const again = setInterval(() => {
        if (!busy()) onGone();
      }, LOOK_AGAIN_MS);
      again.unref();
      const off = () => {
        clearInterval(again);
        client.removeListener('drain', onDrain);
        client.removeListener('end', onGone);
        client.removeListener('error', onGone);
      };
      const onDrain = () => {
        off();
        go(); // another waiter may have sent first
      };
      // Gone: sent now, it is answered at once (not queryable).
      const onGone = () => {
        off();
        now();
      };
      client.once('drain', onDrain);
      client.once('end', onGone);
      client.once('error', onGone);
    };
    go();
  });
}
