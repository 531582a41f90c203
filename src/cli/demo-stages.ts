/**
 * Where `palisade demo` runs: an embedded PGlite served to the worker
 * processes over a unix socket, or the Postgres at DATABASE_URL with the
 * demo's tables in a temporary schema.
 */
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Database } from '../driver.js';
import { CliError } from '../errors.js';
import type { OptionalPeer } from '../optional.js';
import { describeUrl, loadCliPeer } from './common.js';
import type { DemoConnection } from './demo-shared.js';

/**
 * A place where the story runs: the database the workers share. Its
 * connection settings are known before it starts, so the worker processes
 * boot while the database does.
 */
export interface Stage {
  readonly connection: DemoConnection;
  readonly description: string;
  start(): Promise<Database>;
  close(): Promise<void>;
}

/** The packages the embedded stage loads (the workers connect with postgres.js). */
export const EMBEDDED_PEERS = [
  '@electric-sql/pglite',
  '@electric-sql/pglite-socket',
  'drizzle-orm/pglite',
  'postgres',
] as const satisfies readonly OptionalPeer[];
/** The packages the Postgres stage loads. */
export const POSTGRES_PEERS = ['postgres', 'drizzle-orm/postgres-js'] as const satisfies readonly OptionalPeer[];

export function embeddedStage(): Stage {
  const dir = mkdtempSync(join(tmpdir(), 'palisade-demo-'));
  const port = 5432;
  const path = join(dir, `.s.PGSQL.${port}`);
  let stop = async () => {};
  return {
    connection: { kind: 'socket', dir, port },
    description: `embedded PGlite, served to the worker processes on the unix socket ${path}`,
    async start() {
      // Optional peers of the library; a clone has them (devDependencies).
      const [{ PGlite }, { PGLiteSocketServer }, { drizzle }] = await Promise.all([
        loadCliPeer<typeof import('@electric-sql/pglite')>('@electric-sql/pglite'),
        loadCliPeer<typeof import('@electric-sql/pglite-socket')>('@electric-sql/pglite-socket'),
        loadCliPeer<typeof import('drizzle-orm/pglite')>('drizzle-orm/pglite'),
        loadCliPeer<typeof import('postgres')>('postgres'), // the workers connect with postgres.js
      ]);
      const pglite = new PGlite();
      // Two workers with one connection each; a little room for a reconnect.
      const server = new PGLiteSocketServer({ db: pglite, path, maxConnections: 4 });
      stop = async () => {
        await server.stop().catch(() => {});
        await pglite.close().catch(() => {});
      };
      await server.start();
      return drizzle(pglite) as unknown as Database;
    },
    async close() {
      await stop();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

export function postgresStage(url: string): Stage {
  const schema = `palisade_demo_${randomBytes(4).toString('hex')}`;
  let stop = async () => {};
  return {
    connection: { kind: 'url', url, schema },
    description: `the Postgres at DATABASE_URL (${describeUrl(url)}); demo tables in the temporary schema ${schema}`,
    async start() {
      const [{ default: postgres }, { drizzle }] = await Promise.all([
        loadCliPeer<{ default: typeof import('postgres') }>('postgres'),
        loadCliPeer<typeof import('drizzle-orm/postgres-js')>('drizzle-orm/postgres-js'),
      ]);
      const client = postgres(url, {
        max: 1,
        connect_timeout: 10,
        fetch_types: false, // as every postgres.js client palisade creates (README)
        onnotice: () => {},
        connection: { search_path: schema, application_name: 'palisade-demo' },
      });
      stop = () => client.end({ timeout: 5 }).catch(() => {});
      try {
        await client.unsafe(`create schema ${schema}`);
      } catch (err) {
        throw new CliError(
          `cannot use DATABASE_URL (${describeUrl(url)}): ${err instanceof Error ? err.message : String(err)}`,
        );
      }
      stop = async () => {
        await client.unsafe(`drop schema if exists ${schema} cascade`).catch(() => {});
        await client.end({ timeout: 5 }).catch(() => {});
      };
      return drizzle(client) as unknown as Database;
    },
    close: () => stop(),
  };
}
