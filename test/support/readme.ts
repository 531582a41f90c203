/**
 * The README's TypeScript blocks and the harness each runs in: a small
 * prelude that gives a fragment what the surrounding text assumes (`db`,
 * `locks`, `repo`), a postlude, and what the block must print.
 * test/readme.test.ts checks that every block has one and type-checks them
 * all; it runs the blocks that need no embedded Postgres, and
 * test-slow/readme-pglite.test.ts the ones that start a PGlite (each start
 * costs seconds of CPU).
 */
import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import type { Sql } from 'postgres';
import { packageEntries } from './programs.js';
import { withDatabase } from './scratch-database.js';
import { services } from './services.js';

const run = promisify(execFile);

/** The README's text. */
export const README = readFileSync('README.md', 'utf8');

/** Every ```ts block, dedented (some sit in a list item). */
export const blocks = [...README.matchAll(/^( *)```ts\n([\s\S]*?)^\1```/gm)].map((m) => {
  const indent = (m[1] as string).length;
  return (m[2] as string)
    .split('\n')
    .map((line) => line.slice(Math.min(indent, line.length - line.trimStart().length)))
    .join('\n');
});

const PGLITE_DB = `import { PGlite } from '@electric-sql/pglite';
import { drizzle } from 'drizzle-orm/pglite';
const db = drizzle(new PGlite());
`;

/** How one README block runs: what it is given before and after, and what it must print. */
export interface Harness {
  readonly name: string;
  /** A substring only this block has. */
  readonly marker: string;
  readonly prelude?: string;
  readonly postlude?: string;
  readonly needs?: readonly ('DATABASE_URL' | 'REDIS_URL')[];
  readonly cwd?: string;
  /** What the last lines printed on stdout must be. */
  readonly prints: string;
}

/** One harness per TypeScript block of the README (test/readme.test.ts checks that). */
export const harnesses: Harness[] = [
  {
    name: 'In twenty lines (PGlite)',
    marker: 'const db = drizzle(new PGlite());',
    // The block ends the program: nothing it leaves may keep Node alive (an open PGlite's timers would).
    postlude: `await new Promise((resolve) => setImmediate(resolve));
console.log(process.getActiveResourcesInfo().includes('Timeout') ? 'a timer keeps the process alive' : 'exits');
`,
    prints: 'applied\nexits',
  },
  {
    name: 'Quick start on your own Postgres',
    marker: 'stops its LISTEN connection; without it',
    needs: ['DATABASE_URL'],
    prints: 'applied',
  },
  {
    name: 'the LockManager interface',
    marker: "const lease = await locks.acquire('invoice:42'",
    prelude: `${PGLITE_DB}import { migrate, postgresLockManager } from 'palisade-db';
await migrate(db);
const locks = postgresLockManager({ client: db, namespace: 'readme' });
const signal = AbortSignal.timeout(60_000);
const ttlMs = 5_000;
const log = console;
`,
    postlude: `console.log(lease.signal.aborted ? 'released' : 'still held');\nprocess.exit(0);\n`,
    prints: 'released',
  },
  {
    name: 'Redis',
    marker: 'new Redis(process.env.REDIS_URL',
    needs: ['DATABASE_URL', 'REDIS_URL'],
    prints: 'released',
  },
  {
    name: 'migrate with an application folder',
    marker: "migrate(db, { migrationsFolder: './drizzle' })",
    prelude: PGLITE_DB,
    cwd: 'test/fixtures/app',
    postlude: `console.log(result.applied.map((m) => m.folder).at(-1));\nprocess.exit(0);\n`,
    prints: 'app',
  },
  {
    name: 'fence columns on an existing table',
    marker: 'export const widgets = pgTable(',
    prelude: `import { integer, pgTable, text } from 'drizzle-orm/pg-core';\nimport { fenceColumns } from 'palisade-db';\n`,
    postlude: `console.log(widgets.lastFence.name, widgets.deletedAt.name);\n`,
    prints: 'last_fence deleted_at',
  },
  {
    name: 'palisade-db/testing',
    marker: 'assertStaleWriteRefused({',
    prelude: `import { strict as assert } from 'node:assert';
${PGLITE_DB}import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { fenceColumns, fencedRepository, migrate, postgresLockManager } from 'palisade-db';
const pending: Promise<void>[] = [];
const it = (_name: string, fn: () => Promise<void>) => void pending.push(fn());
const expect = (actual: unknown) => ({ toEqual: (expected: unknown) => assert.deepEqual(actual, expected) });
await migrate(db);
const accounts = pgTable('accounts', { id: text('id').primaryKey(), balance: integer('balance').notNull(), ...fenceColumns() });
await db.execute(sql\`create table accounts (id text primary key, balance int not null,
  last_fence bigint not null default 0, deleted_at timestamptz)\`);
await db.execute(sql\`insert into accounts (id, balance) values ('acct-1', 0)\`);
const locks = postgresLockManager({ client: db, namespace: 'readme' });
const repo = fencedRepository(db, accounts);
`,
    postlude: `await Promise.all(pending);\nconsole.log('refused');\nprocess.exit(0);\n`,
    prints: 'refused',
  },
  {
    name: 'lock scope',
    marker: "const invoices = fencedRepository(db, invoicesTable, { scope: 'lock' });",
    prelude: `${PGLITE_DB}import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { fenceColumns, fencedRepository, migrate, postgresLockManager } from 'palisade-db';
await migrate(db);
const invoicesTable = pgTable('invoices', { id: integer('id').primaryKey(), status: text('status').notNull(), ...fenceColumns() });
await db.execute(sql\`create table invoices (id int primary key, status text not null,
  last_fence bigint not null default 0, deleted_at timestamptz)\`);
await db.execute(sql\`insert into invoices (id, status) values (42, 'draft')\`);
const locks = postgresLockManager({ client: db, namespace: 'readme' });
`,
    postlude: `process.exit(0);\n`,
    prints: 'lock_scope',
  },
  {
    name: 'fenced transactions',
    marker: 'const result = await fencedTransaction(db, [lease]',
    prelude: `${PGLITE_DB}import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { fenceColumns, fencedRepository, fencedTransaction, migrate, postgresLockManager } from 'palisade-db';
await migrate(db);
const accountsTable = pgTable('accounts', { id: text('id').primaryKey(), balance: integer('balance').notNull(), ...fenceColumns() });
const ledgerTable = pgTable('ledger', {
  id: text('id').primaryKey(),
  from: text('from_account').notNull(),
  to: text('to_account').notNull(),
  amount: integer('amount').notNull(),
  ...fenceColumns(),
});
await db.execute(sql\`create table accounts (id text primary key, balance int not null,
  last_fence bigint not null default 0, deleted_at timestamptz)\`);
await db.execute(sql\`create table ledger (id text primary key, from_account text not null, to_account text not null,
  amount int not null, last_fence bigint not null default 0, deleted_at timestamptz)\`);
await db.execute(sql\`insert into accounts (id, balance) values ('a', 10), ('b', 0)\`);
const accounts = fencedRepository(db, accountsTable);
const ledger = fencedRepository(db, ledgerTable);
const locks = postgresLockManager({ client: db, namespace: 'readme' });
const lease = await locks.acquire('transfer:a', { ttlMs: 10_000 });
const [from, to, amount, entryId] = ['a', 'b', 5, 'entry-1'] as const;
`,
    postlude: `console.log(result.status);\nprocess.exit(0);\n`,
    prints: 'applied',
  },
  {
    name: 'Writing a lock backend',
    marker: 'function mapLockBackend(): LockBackend {',
    postlude: `process.exit(0);\n`,
    prints: '1n released',
  },
  {
    name: 'the lock backend contract suite',
    marker: "describeLockBackend('my backend'",
    // Registers the checks with a runner that only counts them: the suite itself runs in test/fencing/.
    prelude: `import { postgresLockBackend } from 'palisade-db/backend';
import { PGlite } from '@electric-sql/pglite';
import { drizzle } from 'drizzle-orm/pglite';
const checks: string[] = [];
const describe = (_name: string, body: () => void) => body();
const it = (name: string, _fn: () => Promise<void>) => void checks.push(name);
const expect = (_actual: unknown) => ({ toBe: (_e: unknown) => {}, toEqual: (_e: unknown) => {} });
const myLockBackend = (o: { namespace: string }) => postgresLockBackend({ client: drizzle(new PGlite()), namespace: o.namespace });
`,
    postlude: `console.log(\`\${checks.length} checks\`);\nprocess.exit(0);\n`,
    prints: '9 checks',
  },
  {
    name: 'OpenTelemetry',
    marker: 'configureTelemetry({',
    prelude: `import { MeterProvider } from '@opentelemetry/sdk-metrics';
import { BasicTracerProvider } from '@opentelemetry/sdk-trace-base';
const meterProvider = new MeterProvider();
const tracerProvider = new BasicTracerProvider();
`,
    postlude: `console.log('configured');\nprocess.exit(0);\n`,
    prints: 'configured',
  },
];

/** Whether a harness's program starts an embedded PGlite (its prelude or its block does). */
export const startsPglite = (harness: Harness): boolean =>
  `${harness.prelude ?? ''}${blocks.find((b) => b.includes(harness.marker)) ?? ''}`.includes('new PGlite(');

function source(harness: Harness, block: string): string {
  const code = `${harness.prelude ?? ''}${block}\n${harness.postlude ?? ''}`;
  let pointed = code;
  for (const [entry, path] of packageEntries('.'))
    pointed = pointed.replaceAll(`from '${entry}'`, `from '${resolve(path)}'`);
  return pointed.replaceAll("namespace: 'orders'", `namespace: 'readme-${randomBytes(4).toString('hex')}'`);
}

/** Writes each harnessed block as a program into `dir`; the program of each harness that found its block. */
export function writeBlocks(dir: string): Map<Harness, string> {
  mkdirSync(dir, { recursive: true });
  const files = new Map<Harness, string>();
  for (const harness of harnesses) {
    const block = blocks.find((b) => b.includes(harness.marker));
    if (!block) continue;
    const file = join(dir, `${harness.name.replace(/[^a-z0-9]+/gi, '-')}.mts`);
    writeFileSync(file, source(harness, block));
    files.set(harness, file);
  }
  return files;
}

/**
 * Runs a block's program as a user would (`node --import tsx`), in a database
 * of its own when it needs DATABASE_URL (its name goes to `databases`, for the
 * caller to drop); the last lines it printed.
 */
export async function runBlock(
  harness: Harness,
  file: string,
  admin: Sql | undefined,
  databases: string[],
): Promise<string[]> {
  const env: Record<string, string | undefined> = { ...process.env };
  if (harness.needs?.includes('DATABASE_URL')) {
    const name = `palisade_readme_${randomBytes(5).toString('hex')}`;
    await admin?.unsafe(`create database ${name}`);
    databases.push(name);
    env.DATABASE_URL = withDatabase(services.postgres.url as string, name);
  }
  const { stdout } = await run(process.execPath, ['--import', 'tsx', file], {
    timeout: 170_000,
    cwd: harness.cwd ?? '.',
    env,
  });
  return stdout.trim().split('\n').slice(-harness.prints.split('\n').length);
}
