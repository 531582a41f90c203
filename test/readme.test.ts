/**
 * The README is a claim: every TypeScript block in it is type-checked (strict,
 * NodeNext, against palisade's sources) and run as written — a fragment
 * after a small prelude that gives it what the surrounding text assumes
 * (`db`, `locks`, `repo`). A block without a harness fails the suite, so a
 * new snippet cannot go untested. The error table is checked against
 * `ERROR_CODES`.
 */
import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ERROR_CLASSES, ERROR_CODES, type PalisadeErrorCode } from '../src/errors.js';
import { packageEntries } from './support/programs.js';
import { withDatabase } from './support/scratch-database.js';
import { needs, services } from './support/services.js';

const run = promisify(execFile);
const README = readFileSync('README.md', 'utf8');

/** Every ```ts block, dedented (some sit in a list item). */
const blocks = [...README.matchAll(/^( *)```ts\n([\s\S]*?)^\1```/gm)].map((m) => {
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

interface Harness {
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

const harnesses: Harness[] = [
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

const dir = resolve('node_modules', '.cache', `palisade-readme-${process.pid}`);
const files = new Map<Harness, string>();
const admin = services.postgres.url ? postgres(services.postgres.url, { max: 1, onnotice: () => {} }) : undefined;
const databases: string[] = [];

function source(harness: Harness, block: string): string {
  const code = `${harness.prelude ?? ''}${block}\n${harness.postlude ?? ''}`;
  let pointed = code;
  for (const [entry, path] of packageEntries('.'))
    pointed = pointed.replaceAll(`from '${entry}'`, `from '${resolve(path)}'`);
  return pointed.replaceAll("namespace: 'orders'", `namespace: 'readme-${randomBytes(4).toString('hex')}'`);
}

beforeAll(() => {
  mkdirSync(dir, { recursive: true });
  for (const harness of harnesses) {
    const block = blocks.find((b) => b.includes(harness.marker));
    if (!block) continue;
    const file = join(dir, `${harness.name.replace(/[^a-z0-9]+/gi, '-')}.mts`);
    writeFileSync(file, source(harness, block));
    files.set(harness, file);
  }
});

afterAll(async () => {
  rmSync(dir, { recursive: true, force: true });
  for (const name of databases) await admin?.unsafe(`drop database if exists ${name} with (force)`);
  await admin?.end({ timeout: 5 });
});

describe('README', () => {
  it('every TypeScript block has exactly one harness, and every harness a block', () => {
    expect(blocks.length).toBeGreaterThanOrEqual(7);
    for (const block of blocks) {
      expect(harnesses.filter((h) => block.includes(h.marker)).map((h) => h.name)).toHaveLength(1);
    }
    for (const harness of harnesses) expect(blocks.filter((b) => b.includes(harness.marker))).toHaveLength(1);
  });

  it('every TypeScript block type-checks (strict, NodeNext)', { timeout: 180_000 }, async () => {
    const tsconfig = join(dir, 'tsconfig.json');
    writeFileSync(
      tsconfig,
      JSON.stringify({
        compilerOptions: {
          target: 'ES2022',
          module: 'NodeNext',
          moduleResolution: 'NodeNext',
          lib: ['ES2023', 'ES2024.String'], // as palisade's own tsconfig: its sources are checked too
          types: ['node'],
          strict: true,
          noUncheckedIndexedAccess: true,
          skipLibCheck: true,
          noEmit: true,
          allowImportingTsExtensions: true,
        },
        files: [...files.values()],
      }),
    );
    const tsc = resolve('node_modules/typescript/bin/tsc');
    const result = await run(process.execPath, [tsc, '-p', tsconfig], { timeout: 170_000 }).then(
      () => '',
      (err: { stdout?: string }) => err.stdout ?? String(err),
    );
    expect(result).toBe('');
  });

  for (const harness of harnesses) {
    const enabled = (harness.needs ?? []).every((variable) => needs(variable));
    it.runIf(enabled)(`"${harness.name}" runs as written`, { timeout: 180_000 }, async () => {
      const file = files.get(harness);
      expect(file).toBeDefined();
      const env: Record<string, string | undefined> = { ...process.env };
      if (harness.needs?.includes('DATABASE_URL')) {
        const name = `palisade_readme_${randomBytes(5).toString('hex')}`;
        await admin?.unsafe(`create database ${name}`);
        databases.push(name);
        env.DATABASE_URL = withDatabase(services.postgres.url as string, name);
      }
      const { stdout } = await run(process.execPath, ['--import', 'tsx', file as string], {
        timeout: 170_000,
        cwd: harness.cwd ?? '.',
        env,
      });
      const expected = harness.prints.split('\n');
      expect(stdout.trim().split('\n').slice(-expected.length)).toEqual(expected);
    });
  }

  it('the error table lists exactly the codes of ERROR_CODES, each once, with its class', () => {
    const section = README.slice(README.indexOf('## Errors'), README.indexOf('\n## ', README.indexOf('## Errors') + 5));
    const rows = [...section.matchAll(/^\| `([a-z_]+)` \| `([A-Za-z]+)` \|/gm)].map((m) => [m[1], m[2]]);
    expect(rows.map(([code]) => code).sort()).toEqual(Object.keys(ERROR_CODES).sort());
    expect(Object.keys(ERROR_CLASSES).sort()).toEqual(Object.keys(ERROR_CODES).sort());
    for (const [code, name] of rows) expect(name).toBe(ERROR_CLASSES[code as PalisadeErrorCode].name);
  });
});
