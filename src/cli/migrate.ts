/**
 * `palisade migrate`: palisade's own migrations plus, optionally, the
 * application's drizzle-kit folder, under the migration advisory lock — safe
 * to run from every replica at start-up.
 */
import { existsSync } from 'node:fs';
import { resolve } from 'node:path';
import type { Database } from '../driver.js';
import { CliError, InvalidArgumentError, LockUnavailableError, PalisadeError } from '../errors.js';
import { type MigrateEvent, migrate } from '../migrate.js';
import {
  type Command,
  connect,
  connectionError,
  describeUrl,
  loadCliPeer,
  parse,
  requireDatabaseUrl,
  toJson,
} from './common.js';

const help = `Usage: palisade migrate [--migrations-folder DIR] [--lock-timeout SECONDS] [--json]

Applies palisade's own migrations (schema "palisade": fence sequences, lease
table) and then, if given, your drizzle-kit migrations folder — in one
transaction, under a Postgres advisory lock. Every replica may run it at
start-up: one applies, the others wait and find nothing left to do.

Options:
  --migrations-folder DIR  your drizzle-kit "out" folder (with meta/_journal.json)
  --migrations-table NAME  where your migrations are recorded (default __drizzle_migrations)
  --migrations-schema NAME schema of that table (default drizzle)
  --lock-timeout SECONDS   give up if another migrator holds the lock this long (default 600)
  --json                   print what was applied as JSON on stdout
  -h, --help               this help

Environment:
  DATABASE_URL             the Postgres to migrate (required)

Exit codes: 0 migrated (or nothing to do), 1 failed (nothing of this run kept), 2 bad usage.`;

export const migrateCommand: Command = {
  summary: "apply palisade's migrations (and yours) safely from many replicas at once",
  help,
  async run(argv, io) {
    const { values } = parse('migrate', argv, {
      'migrations-folder': { type: 'string' },
      'migrations-table': { type: 'string' },
      'migrations-schema': { type: 'string' },
      'lock-timeout': { type: 'string' },
      json: { type: 'boolean' },
    });
    if (values.help) {
      io.out(help);
      return 0;
    }
    const folder = values['migrations-folder'] ? resolve(String(values['migrations-folder'])) : undefined;
    if (folder && !existsSync(resolve(folder, 'meta', '_journal.json'))) {
      throw new CliError(`${folder} is not a drizzle-kit migrations folder (no meta/_journal.json)`, 2);
    }
    let lockTimeoutMs: number | undefined;
    if (values['lock-timeout'] !== undefined) {
      const seconds = Number(values['lock-timeout']);
      if (!Number.isFinite(seconds) || seconds <= 0 || seconds > 86_400) {
        throw new CliError('--lock-timeout must be a number of seconds in (0, 86400]', 2);
      }
      lockTimeoutMs = Math.max(1, Math.round(seconds * 1000));
    }
    const url = requireDatabaseUrl(io, 'palisade migrate needs the Postgres server to migrate');
    const json = values.json === true;
    // Once the server has answered (the lock taken or queued for), a closed connection is a failed
    // migration, not a failed connect.
    let connected = false;
    const progress = (event: MigrateEvent) => {
      connected = true;
      if (event.type === 'waiting') io.err('another migrator holds the lock; waiting for it to finish…');
      else if (event.type === 'applying') io.err(`applying ${event.folder} migration ${event.tag}…`);
    };
    io.err(`migrating ${describeUrl(url)}${folder ? ` (palisade + ${folder})` : ' (palisade only)'}`);
    const client = await connect(url);
    try {
      const { drizzle } = await loadCliPeer<typeof import('drizzle-orm/postgres-js')>('drizzle-orm/postgres-js');
      const db = drizzle(client) as unknown as Database;
      const result = await migrate(db, {
        ...(folder ? { migrationsFolder: folder } : {}),
        ...(values['migrations-table'] ? { migrationsTable: String(values['migrations-table']) } : {}),
        ...(values['migrations-schema'] ? { migrationsSchema: String(values['migrations-schema']) } : {}),
        ...(lockTimeoutMs ? { lockTimeoutMs } : {}),
        onProgress: progress,
      });
      if (json) io.out(toJson(result));
      else if (result.applied.length === 0) io.out(`up to date: ${result.skipped.length} migrations already applied`);
      else io.out(`applied ${result.applied.length} migrations (${result.skipped.length} were already applied)`);
      return 0;
    } catch (err) {
      const e = connected ? err : connectionError(err, url);
      if (e instanceof CliError) throw e;
      // Refused before any query (an option migrate() rejects): bad usage.
      if (e instanceof InvalidArgumentError) throw new CliError(e.message, 2);
      // The migration lock's name is palisade's own constant: name it (lock errors' messages leave names out).
      if (e instanceof LockUnavailableError) {
        throw new CliError(
          `migration failed, nothing applied: lock ${JSON.stringify(e.lockName)} not acquired (${e.reason})`,
        );
      }
      if (e instanceof PalisadeError) throw new CliError(`migration failed, nothing applied: ${e.message}`);
      throw new CliError(`migration failed, nothing applied: ${e instanceof Error ? e.message : String(e)}`);
    } finally {
      await client.end({ timeout: 5 });
    }
  },
};
