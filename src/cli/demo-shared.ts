/**
 * What `palisade demo` and its worker processes share: the demo's table,
 * the connection settings handed to a worker, and the line protocol
 * between them. Internal to the CLI.
 */
import { integer, pgTable } from 'drizzle-orm/pg-core';
import { fenceColumns } from '../schema/fence-columns.js';

/** The row both workers increment: `visits` should end at the number of increments made. */
export const demoCounter = pgTable('palisade_demo_counter', {
  id: integer('id').primaryKey(),
  visits: integer('visits').notNull(),
  ...fenceColumns(),
});

/** Where a worker connects: the embedded PGlite over its unix socket, or a real server. */
export type DemoConnection =
  | { readonly kind: 'socket'; readonly dir: string; readonly port: number }
  | { readonly kind: 'url'; readonly url: string; readonly schema: string };

/** argv[2] of a demo worker, as JSON. */
export interface WorkerConfig {
  readonly label: string;
  readonly connection: DemoConnection;
  /** With it, naive locks are `SET NX PX` and palisade leases come from the Redis backend. */
  readonly redisUrl?: string;
  /** Lock-manager namespace and naive-lock key prefix: unique per demo run. */
  readonly namespace: string;
  readonly lock: string;
  readonly ttlMs: number;
}

/** A command from the demo to a worker: one JSON line on the worker's stdin. */
export type WorkerCommand = { readonly id: number } & (
  | { readonly cmd: 'naive-acquire'; readonly waitMs: number }
  | { readonly cmd: 'naive-release' }
  | { readonly cmd: 'read'; readonly row: number }
  | { readonly cmd: 'naive-write'; readonly row: number; readonly visits: number }
  | { readonly cmd: 'acquire'; readonly waitMs: number }
  | { readonly cmd: 'fenced-write'; readonly row: number; readonly visits: number }
  | { readonly cmd: 'increment'; readonly row: number }
  | { readonly cmd: 'lease-state' }
  | { readonly cmd: 'release' }
  | { readonly cmd: 'ping' }
  | { readonly cmd: 'exit' }
);

/** A worker's answer: one JSON line on its stdout, `id` of the command; bigints as decimal strings. */
export type WorkerReply =
  | ({ readonly id: number } & ({ readonly ok: true } & Record<string, unknown>))
  | {
      readonly id: number;
      readonly ok: false;
      readonly error: string;
    };

/** The postgres.js settings of a demo worker: one connection each (the PGlite socket multiplexes a few). */
export function postgresOptions(connection: DemoConnection) {
  // fetch_types: false, as every postgres.js client palisade creates (README, the driver faults it names).
  const common = { max: 1, onnotice: () => {}, connect_timeout: 10, fetch_types: false } as const;
  if (connection.kind === 'socket') {
    // Every connection shares PGlite's single session: keep no named statements in it.
    return {
      ...common,
      prepare: false,
      host: connection.dir,
      port: connection.port,
      database: 'postgres',
      username: 'postgres',
    };
  }
  return { ...common, connection: { search_path: connection.schema } };
}
