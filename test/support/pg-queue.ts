import type pg from 'pg';

/**
 * Counts the statements handed to a client of `pool` while another waited in that client's queue —
 * what node-postgres 8 deprecates (a `DeprecationWarning`, printed once a process) and pg 9 drops.
 * Reads pg's own queue (`_queryQueue`), the one its warning checks.
 */
export function queuedPushes(pool: pg.Pool): { n: number } {
  const queued = { n: 0 };
  pool.on('connect', (client) => {
    const query = client.query.bind(client) as (...args: unknown[]) => unknown;
    const queue = client as unknown as { _queryQueue: unknown[] };
    (client as unknown as { query: typeof query }).query = (...args) => {
      if (queue._queryQueue.length > 0) queued.n++;
      return query(...args);
    };
  });
  return queued;
}
