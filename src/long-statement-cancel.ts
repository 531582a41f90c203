/**
 * Cancelling, out of band, a statement that a stopped transaction still
 * runs (src/repo/lost-lease.ts): the protocol's cancel request, sent on a
 * connection of its own, so no connection of the pool is needed — the
 * transactions of one lease may hold all of them, each in a statement only
 * a cancel ends. Only a statement seen running at two calls in a row is
 * cancelled: a cancel request still in flight when a short statement ends
 * could hit what the session runs next (the rollback).
 */
import { createConnection } from 'node:net';

/** @internal How a transaction's running statement is cancelled out of band. */
export interface LongStatementCancel {
  /** Notes a statement the transaction sent (postgres.js; node-postgres asks its client instead). */
  sent(query: unknown): void;
  /** Cancels the statement the transaction runs if it ran it at the previous call too; at most once each. */
  cancel(): void;
}

/** What of a postgres.js query this reads (postgres 3.4: set while it runs; its canceller until used). */
interface PostgresQuery {
  readonly active?: boolean;
  canceller?: ((query: PostgresQuery) => Promise<unknown>) | null;
}

// The statements of a transaction kept: the latest ones (they run one after another; a pipeline deeper
// than this leaves its oldest to the look from the pool), held weakly — one still running or queued is
// held by the driver, one that finished need not stay.
const KEPT_QUERIES = 64;

/** Calls `cancel(running)` for a statement `running()` gave at the previous call too, once per statement. */
function whenLong<Q>(running: () => Q | undefined, cancel: (query: Q) => void): () => void {
  let seen: Q | undefined;
  let cancelled: Q | undefined;
  return () => {
    const now = running();
    const long = now !== undefined && now === seen;
    seen = now;
    if (!long || now === cancelled) return;
    cancelled = now;
    cancel(now);
  };
}

/** @internal postgres.js: the statements a transaction sends are noted; the running one is cancelled through its own cancel. */
export function postgresJsCancel(): LongStatementCancel {
  const queries: WeakRef<PostgresQuery>[] = [];
  return {
    sent(query) {
      if (queries.push(new WeakRef(query as PostgresQuery)) > KEPT_QUERIES) queries.shift();
    },
    cancel: whenLong(
      () => queries.find((ref) => ref.deref()?.active === true)?.deref(),
      (query) => {
        const cancel = query.canceller;
        if (typeof cancel !== 'function') return;
        query.canceller = null;
        cancel(query)?.catch?.(() => {}); // a cancel that cannot connect: the look from the pool remains
      },
    ),
  };
}

/** What of a node-postgres `Client` this reads (pg 8: what its own `cancel` reads). */
interface PgCancelState {
  readonly _activeQuery?: unknown;
  readonly activeQuery?: unknown;
  readonly host?: unknown;
  readonly port?: unknown;
  readonly processID?: unknown;
  readonly secretKey?: unknown;
}

/** @internal node-postgres: the statement `client` runs, by a cancel request with its process id and secret key. */
export function nodePostgresCancel(client: unknown): LongStatementCancel {
  const pg = client as PgCancelState;
  return {
    sent: () => {},
    cancel: whenLong(
      // pg 8.x keeps it as `_activeQuery` (its `activeQuery` getter warns that it goes in pg 9).
      () => ('_activeQuery' in pg ? pg._activeQuery : pg.activeQuery) ?? undefined,
      () => sendCancelRequest(pg),
    ),
  };
}

// A cancel request the server neither reads nor closes within this long is let go.
const CANCEL_TIMEOUT_MS = 10_000;

/**
 * The protocol's CancelRequest for the session of `client`, on a connection of its own to the same
 * server: the server cancels what that session runs, if it runs anything, and closes the connection.
 * Best effort: nothing is sent where a field is missing, and a connection that fails is let go.
 */
function sendCancelRequest(client: PgCancelState): void {
  const { host, port, processID, secretKey } = client;
  if (typeof port !== 'number' || !Number.isInteger(processID) || !Number.isInteger(secretKey)) return;
  const request = Buffer.alloc(16);
  request.writeInt32BE(16, 0);
  request.writeInt32BE(80877102, 4); // the CancelRequest code
  request.writeInt32BE(processID as number, 8);
  request.writeInt32BE(secretKey as number, 12);
  const server =
    typeof host === 'string' && host.startsWith('/')
      ? { path: `${host}/.s.PGSQL.${port}` }
      : { host: typeof host === 'string' ? host : 'localhost', port };
  const socket = createConnection(server, () => socket.end(request));
  socket.on('error', () => socket.destroy());
  socket.setTimeout(CANCEL_TIMEOUT_MS, () => socket.destroy());
  socket.unref();
}
