/**
 * The package as a stranger gets it: `npm pack` (prepack cleans and
 * builds), then fresh apps that install the tarball and type-check and run
 * a fenced write — ESM NodeNext, Bundler resolution, CommonJS via require,
 * each drizzle driver, the lowest drizzle-orm and the newest postgres.js
 * and PGlite the peer ranges admit.
 *
 * Offline: each app gets a lock file cut from this repository's own (the
 * same versions and integrity hashes), and `npm ci --offline` takes every
 * tarball from the npm cache that this repository's `npm ci` filled. The
 * type-checker is this repository's TypeScript.
 *
 * Not offline, on purpose: the README's install lines resolved against the
 * registry as it is today (a new major of a peer, published since, once
 * made every one of them fail with ERESOLVE while the offline apps passed).
 *
 * Slow (a build and nine installs): `npm run test:package`, not `npm test`.
 */
import { execFile } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { withDatabase } from '../support/scratch-database.js';
import { services } from '../support/services.js';

const run = promisify(execFile);
const ROOT = resolve('.');
const TSC = join(ROOT, 'node_modules', 'typescript', 'bin', 'tsc');
const LOCK = JSON.parse(readFileSync(join(ROOT, 'package-lock.json'), 'utf8')) as {
  packages: Record<string, LockEntry>;
};
const MANIFEST = JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8')) as {
  version: string;
  devDependencies: Record<string, string>;
};
/**
 * Other ends of the peer ranges than the devDependencies: installed here under npm aliases (the lowest
 * drizzle-orm, the newest postgres.js and PGlite), each taken by an app that asks for its version.
 */
const ALIASES: Record<string, string> = {
  'drizzle-orm': 'drizzle-orm-lowest',
  postgres: 'postgres-newest',
  '@electric-sql/pglite': 'pglite-newest',
};
const aliased = (name: string) => MANIFEST.devDependencies[ALIASES[name] ?? '']?.replace(`npm:${name}@`, '') ?? '';
const LOWEST_DRIZZLE = aliased('drizzle-orm');
const NEWEST_POSTGRES = aliased('postgres');
const NEWEST_PGLITE = aliased('@electric-sql/pglite');

interface LockEntry {
  name?: string;
  version: string;
  resolved?: string;
  integrity?: string;
  dependencies?: Record<string, string>;
  optionalDependencies?: Record<string, string>;
  [key: string]: unknown;
}

let work: string;
let tarball: string;
let packed: { files: string[]; size: number; unpackedSize: number };
const admin = services.postgres.url ? postgres(services.postgres.url, { max: 1, onnotice: () => {} }) : undefined;
const databases: string[] = [];

beforeAll(async () => {
  work = mkdtempSync(join(tmpdir(), 'palisade-package-'));
  // prepack runs here: clean, then build.
  const { stdout } = await run('npm', ['pack', '--json', '--pack-destination', work], {
    cwd: ROOT,
    timeout: 240_000,
    maxBuffer: 16 * 1024 * 1024,
  });
  const [info] = JSON.parse(stdout.slice(stdout.indexOf('['))) as {
    filename: string;
    size: number;
    unpackedSize: number;
    files: { path: string }[];
  }[];
  if (!info) throw new Error('npm pack printed no result');
  tarball = join(work, info.filename);
  packed = { files: info.files.map((f) => f.path).sort(), size: info.size, unpackedSize: info.unpackedSize };
  console.log(
    `packed ${info.filename}: ${packed.files.length} files, ${info.size} bytes (${info.unpackedSize} unpacked)`,
  );
}, 300_000);

afterAll(async () => {
  if (work) rmSync(work, { recursive: true, force: true });
  for (const name of databases) await admin?.unsafe(`drop database if exists ${name} with (force)`);
  await admin?.end({ timeout: 5 });
});

describe('the tarball', () => {
  it('holds exactly the checked file list (npm pack --dry-run)', async () => {
    await expect(`${packed.files.join('\n')}\n`).toMatchFileSnapshot('./files.snapshot.txt');
    expect(statSync(tarball).size).toBe(packed.size);
  });

  it('has no CLI-internal declarations, no drizzle-kit snapshots, a LICENSE and the documents the README links to', () => {
    expect(packed.files.filter((f) => f.startsWith('dist/cli/') && f.endsWith('.d.ts'))).toEqual([]);
    expect(packed.files.filter((f) => f.endsWith('_snapshot.json'))).toEqual([]);
    const readme = readFileSync('README.md', 'utf8');
    const linked = [...readme.matchAll(/\]\(((?!https?:|#)[^)]+)\)/g)].map((m) => (m[1] as string).split('#')[0]);
    for (const path of ['LICENSE', ...linked]) expect(packed.files).toContain(path);
  });
});

/** A lock file for an app: the root's dependencies, and each package's entry (and its dependencies') from ours. */
function lockFor(deps: Record<string, string>): object {
  const packages: Record<string, LockEntry> = {};
  const root: LockEntry = { name: 'app', version: '1.0.0', dependencies: deps };
  packages[''] = root;
  const add = (name: string, from: string) => {
    // Where our lock file has it: nested under its dependent (a version conflict), or hoisted.
    const nested = from ? `${from}/node_modules/${name}` : undefined;
    const at = nested && LOCK.packages[nested] ? nested : `node_modules/${name}`;
    if (packages[at]) return;
    const alias =
      from === '' && ALIASES[name] !== undefined && deps[name] === aliased(name) ? ALIASES[name] : undefined;
    const source = alias ? LOCK.packages[`node_modules/${alias}`] : LOCK.packages[at];
    if (!source) throw new Error(`${name} is not in this repository's lock file: add it to devDependencies`);
    const { dev: _dev, peer: _peer, name: _alias, ...entry } = source as LockEntry & { dev?: boolean; peer?: boolean };
    // Our lock file names no tarball URL; with one (and the integrity) npm takes the tarball
    // from its cache by hash and needs no registry metadata, which `npm ci` never cached.
    const real = source.name ?? name;
    entry.resolved ??= `https://registry.npmjs.org/${real}/-/${real.split('/').pop()}-${entry.version}.tgz`;
    packages[at] = entry;
    for (const dep of Object.keys({ ...entry.dependencies, ...entry.optionalDependencies })) add(dep, at);
  };
  for (const name of Object.keys(deps)) {
    if (name === 'palisade-db') continue;
    add(name, '');
  }
  packages['node_modules/palisade-db'] = {
    version: MANIFEST.version,
    resolved: `file:${tarball}`,
    license: 'MIT',
  };
  return { name: 'app', version: '1.0.0', lockfileVersion: 3, requires: true, packages };
}

interface App {
  readonly name: string;
  readonly type: 'module' | 'commonjs';
  readonly compilerOptions: Record<string, unknown>;
  readonly deps: Record<string, string>;
  readonly source: string;
  readonly extension?: string;
}

const versionOf = (name: string) => LOCK.packages[`node_modules/${name}`]?.version as string;

async function installAndRun(app: App, env: Record<string, string> = {}): Promise<string> {
  const dir = join(work, app.name);
  mkdirSync(dir);
  const deps: Record<string, string> = {
    'palisade-db': `file:${tarball}`,
    '@types/node': versionOf('@types/node'),
    ...app.deps,
  };
  writeFileSync(
    join(dir, 'package.json'),
    JSON.stringify({ name: 'app', version: '1.0.0', private: true, type: app.type, dependencies: deps }, null, 2),
  );
  writeFileSync(join(dir, 'package-lock.json'), JSON.stringify(lockFor(deps), null, 2));
  writeFileSync(
    join(dir, 'tsconfig.json'),
    JSON.stringify({
      compilerOptions: {
        target: 'ES2022',
        strict: true,
        skipLibCheck: true,
        outDir: 'out',
        types: ['node'],
        ...app.compilerOptions,
      },
      include: ['src'],
    }),
  );
  mkdirSync(join(dir, 'src'));
  const ext = app.extension ?? 'ts';
  writeFileSync(join(dir, 'src', `main.${ext}`), app.source);
  await run('npm', ['ci', '--offline', '--no-audit', '--no-fund', '--ignore-scripts'], { cwd: dir, timeout: 180_000 });
  await run(process.execPath, [TSC, '-p', '.'], { cwd: dir, timeout: 180_000 }).catch((err: { stdout?: string }) => {
    throw new Error(`tsc failed in ${app.name}:\n${err.stdout ?? String(err)}`);
  });
  const js = join(dir, 'out', `main.${ext.replace('ts', 'js')}`);
  const { stdout } = await run(process.execPath, [js], { cwd: dir, timeout: 120_000, env: { ...process.env, ...env } });
  return stdout.trim();
}

/** The README's twenty lines, on the given drizzle driver. */
function fencedWrite(driver: 'pglite' | 'postgres-js' | 'node-postgres'): string {
  const client = {
    pglite: [
      `import { PGlite } from '@electric-sql/pglite';`,
      `import { drizzle } from 'drizzle-orm/pglite';`,
      'const client = new PGlite();',
      'const db = drizzle(client);',
      'await client.close();',
    ],
    'postgres-js': [
      `import postgres from 'postgres';`,
      `import { drizzle } from 'drizzle-orm/postgres-js';`,
      `const client = postgres(process.env.APP_DATABASE_URL ?? '', { max: 2 });`,
      'const db = drizzle(client);',
      'await client.end();',
    ],
    'node-postgres': [
      `import pg from 'pg';`,
      `import { drizzle } from 'drizzle-orm/node-postgres';`,
      `const client = new pg.Pool({ connectionString: process.env.APP_DATABASE_URL });`,
      'const db = drizzle(client);',
      'await client.end();',
    ],
  }[driver];
  const body = `
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { fenceColumns, fencedRepository, migrate, postgresLockManager, type PalisadeErrorCode } from 'palisade-db';
import { assertStaleWriteRefused } from 'palisade-db/testing';
${client[0]}
${client[1]}

const accounts = pgTable('accounts', {
  id: text('id').primaryKey(),
  balance: integer('balance').notNull(),
  ...fenceColumns(),
});

async function main(): Promise<void> {
  ${client[2]}
  ${client[3]}
  await migrate(db);
  await db.execute(sql\`create table accounts (id text primary key, balance int not null,
    last_fence bigint not null default 0, deleted_at timestamptz)\`);
  const locks = postgresLockManager({ client: db, namespace: 'billing' });
  const repo = fencedRepository(db, accounts);
  const status = await locks.using('account:42', { ttlMs: 5_000 }, async (lease) => {
    const result = await repo.upsert({ id: '42', balance: 10 }, lease.fence);
    return result.status;
  });
  const code: PalisadeErrorCode = 'stale_fence';
  const outcome = await assertStaleWriteRefused({
    manager: locks, lock: 'account:43', ttlMs: 200,
    write: (fence) => repo.upsert({ id: '43', balance: 1 }, fence),
  });
  console.log(status, outcome.late.status === 'stale' ? code : 'not refused');
  await locks.close();
  ${client[4]}
}
`;
  return `${body}
await main();
`;
}

/**
 * CommonJS: palisade-db comes in through require() (Node ≥ 20.19 loads the
 * ESM package); drizzle-orm through import(), as the README says, so that
 * the app and palisade share drizzle's ESM copy and its types (drizzle-orm
 * ships separate CommonJS and ESM builds, whose classes do not mix).
 */
const COMMONJS_APP = `
import { fenceColumns, fencedRepository, migrate, postgresLockManager } from 'palisade-db';
import type { PalisadeErrorCode } from 'palisade-db';

async function main(): Promise<void> {
  const { sql } = await import('drizzle-orm');
  const { integer, pgTable, text } = await import('drizzle-orm/pg-core');
  const { drizzle } = await import('drizzle-orm/pglite');
  const { PGlite } = await import('@electric-sql/pglite');
  const { assertStaleWriteRefused } = await import('palisade-db/testing');
  const accounts = pgTable('accounts', {
    id: text('id').primaryKey(),
    balance: integer('balance').notNull(),
    ...fenceColumns(),
  });
  const client = new PGlite();
  const db = drizzle(client);
  await migrate(db);
  await db.execute(sql\`create table accounts (id text primary key, balance int not null,
    last_fence bigint not null default 0, deleted_at timestamptz)\`);
  const locks = postgresLockManager({ client: db, namespace: 'billing' });
  const repo = fencedRepository(db, accounts);
  const status = await locks.using('account:42', { ttlMs: 5_000 }, async (lease) => {
    const result = await repo.upsert({ id: '42', balance: 10 }, lease.fence);
    return result.status;
  });
  const code: PalisadeErrorCode = 'stale_fence';
  const outcome = await assertStaleWriteRefused({
    manager: locks, lock: 'account:43', ttlMs: 200,
    write: (fence) => repo.upsert({ id: '43', balance: 1 }, fence),
  });
  console.log(status, outcome.late.status === 'stale' ? code : 'not refused');
  await locks.close();
  await client.close();
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
`;

async function freshDatabase(): Promise<string> {
  if (!admin || !services.postgres.url) throw new Error('DATABASE_URL is not set');
  const name = `palisade_pkg_${randomBytes(5).toString('hex')}`;
  await admin.unsafe(`create database ${name}`);
  databases.push(name);
  return withDatabase(services.postgres.url, name);
}

const latest = { 'drizzle-orm': versionOf('drizzle-orm') };
const pglite = { '@electric-sql/pglite': versionOf('@electric-sql/pglite') };
const EXPECTED = 'applied stale_fence';

describe('fresh apps install the tarball offline, type-check, and write fenced', () => {
  it('ESM, module NodeNext, PGlite', { timeout: 400_000 }, async () => {
    const out = await installAndRun({
      name: 'esm-nodenext-pglite',
      type: 'module',
      compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext' },
      deps: { ...latest, ...pglite },
      source: fencedWrite('pglite'),
    });
    expect(out).toBe(EXPECTED);
  });

  it('ESM, moduleResolution Bundler, PGlite', { timeout: 400_000 }, async () => {
    const out = await installAndRun({
      name: 'esm-bundler-pglite',
      type: 'module',
      compilerOptions: { module: 'ESNext', moduleResolution: 'Bundler' },
      deps: { ...latest, ...pglite },
      source: fencedWrite('pglite'),
    });
    expect(out).toBe(EXPECTED);
  });

  it('CommonJS (require of the ESM package), module nodenext, PGlite', { timeout: 400_000 }, async () => {
    const out = await installAndRun({
      name: 'cjs-nodenext-pglite',
      type: 'commonjs',
      compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext' },
      deps: { ...latest, ...pglite },
      source: COMMONJS_APP,
      extension: 'cts',
    });
    expect(out).toBe(EXPECTED);
  });

  it(`the lowest supported drizzle-orm (${LOWEST_DRIZZLE}), ESM NodeNext, PGlite`, { timeout: 400_000 }, async () => {
    const out = await installAndRun({
      name: 'esm-lowest-drizzle',
      type: 'module',
      compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext' },
      deps: { 'drizzle-orm': LOWEST_DRIZZLE, ...pglite },
      source: fencedWrite('pglite'),
    });
    expect(out).toBe(EXPECTED);
  });

  it('postgres-js on the real Postgres', { timeout: 400_000 }, async () => {
    const out = await installAndRun(
      {
        name: 'esm-postgres-js',
        type: 'module',
        compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext' },
        deps: { ...latest, postgres: versionOf('postgres') },
        source: fencedWrite('postgres-js'),
      },
      { APP_DATABASE_URL: await freshDatabase() },
    );
    expect(out).toBe(EXPECTED);
  });

  it(`the newest postgres.js the peer range admits (${NEWEST_POSTGRES}) on the real Postgres`, {
    timeout: 400_000,
  }, async () => {
    const out = await installAndRun(
      {
        name: 'esm-postgres-js-newest',
        type: 'module',
        compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext' },
        deps: { ...latest, postgres: NEWEST_POSTGRES },
        source: fencedWrite('postgres-js'),
      },
      { APP_DATABASE_URL: await freshDatabase() },
    );
    expect(out).toBe(EXPECTED);
  });

  it(`the newest PGlite the peer range admits (${NEWEST_PGLITE})`, { timeout: 400_000 }, async () => {
    const out = await installAndRun({
      name: 'esm-pglite-newest',
      type: 'module',
      compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext' },
      deps: { ...latest, '@electric-sql/pglite': NEWEST_PGLITE },
      source: fencedWrite('pglite'),
    });
    expect(out).toBe(EXPECTED);
  });

  it('node-postgres on the real Postgres', { timeout: 400_000 }, async () => {
    const out = await installAndRun(
      {
        name: 'esm-node-postgres',
        type: 'module',
        compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext' },
        deps: { ...latest, pg: versionOf('pg'), '@types/pg': versionOf('@types/pg') },
        source: fencedWrite('node-postgres'),
      },
      { APP_DATABASE_URL: await freshDatabase() },
    );
    expect(out).toBe(EXPECTED);
  });
});

describe('the CLI in an app without a peer it needs', () => {
  it('palisade demo with REDIS_URL and no ioredis: exit 1, one line naming every package the run needs', {
    timeout: 400_000,
  }, async () => {
    const dir = join(work, 'demo-no-ioredis');
    mkdirSync(dir);
    // The demo on a Postgres of one's own (DATABASE_URL), with Redis locks asked for: no ioredis.
    const deps = { 'palisade-db': `file:${tarball}`, ...latest, postgres: versionOf('postgres') };
    writeFileSync(
      join(dir, 'package.json'),
      JSON.stringify({ name: 'app', version: '1.0.0', private: true, dependencies: deps }),
    );
    writeFileSync(join(dir, 'package-lock.json'), JSON.stringify(lockFor(deps), null, 2));
    await run('npm', ['ci', '--offline', '--no-audit', '--no-fund', '--ignore-scripts'], {
      cwd: dir,
      timeout: 180_000,
    });
    const bin = join(dir, 'node_modules', 'palisade-db', 'dist', 'cli', 'main.js');
    const outcome = await run(process.execPath, [bin, 'demo'], {
      cwd: dir,
      timeout: 60_000,
      // Nothing listens on port 1: the check comes before any connection.
      env: { ...process.env, REDIS_URL: 'redis://127.0.0.1:1', DATABASE_URL: 'postgres://127.0.0.1:1/demo' },
    }).then(
      () => ({ code: 0, stderr: '' }),
      (err: { code?: number; stderr?: string }) => ({ code: err.code, stderr: err.stderr ?? '' }),
    );
    expect(outcome.code).toBe(1);
    expect(outcome.stderr.trim().split('\n')).toEqual([
      'palisade demo: needs the package "ioredis", not installed: npm i ioredis (or run the CLI with npx -p palisade-db -p postgres -p drizzle-orm -p ioredis palisade …)',
    ]);
  });
});

describe("the README's install lines, resolved against the registry as a stranger's npm does", () => {
  const lines: Record<string, string[]> = {
    'postgres.js (the first line of the README)': ['drizzle-orm', 'postgres'],
    'node-postgres': ['drizzle-orm', 'pg', '@types/pg'],
    PGlite: ['drizzle-orm', '@electric-sql/pglite'],
  };
  for (const [what, peers] of Object.entries(lines)) {
    it(`npm i palisade-db ${peers.join(' ')} (${what}) resolves`, { timeout: 200_000 }, async () => {
      const dir = join(work, `resolve-${what.split(' ')[0]?.replace(/\W/g, '')}`);
      mkdirSync(dir);
      writeFileSync(join(dir, 'package.json'), JSON.stringify({ name: 'app', version: '1.0.0', private: true }));
      // --dry-run: the whole tree resolved (peer ranges included), nothing fetched or written.
      const result = await run('npm', ['install', '--dry-run', '--no-audit', '--no-fund', tarball, ...peers], {
        cwd: dir,
        timeout: 180_000,
      }).then(
        () => 'resolved',
        (err: { stderr?: string }) => err.stderr ?? String(err),
      );
      expect(result).toBe('resolved');
    });
  }
});
