/**
 * `@opentelemetry/api` is an optional peer loaded at first use, never with
 * top-level await: the built package must stay loadable with `require()`,
 * and must work — every hook a no-op — when the api package is absent.
 * Built with tsc into a directory of its own, then run with plain node.
 */
import { execFile } from 'node:child_process';
import { cpSync, mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';

const run = promisify(execFile);

// Inside the repository, so the built files resolve our node_modules.
const dir = resolve('node_modules', '.cache', `palisade-require-${process.pid}`);

// A cycle through the built package: a grant, a fenced write, a stale write, on PGlite.
const SCRIPT = `
const palisade = require(process.argv[2]);
const { PGlite } = require('@electric-sql/pglite');
const { drizzle } = require('drizzle-orm/pglite');
const { pgTable, text } = require('drizzle-orm/pg-core');
const { sql } = require('drizzle-orm');
(async () => {
  const client = new PGlite();
  const db = drizzle(client);
  await palisade.migrate(db);
  await db.execute(sql\`create table jobs (id text primary key, state text, last_fence bigint not null default 0, deleted_at timestamptz)\`);
  const jobs = pgTable('jobs', { id: text('id').primaryKey(), state: text('state'), ...palisade.fenceColumns() });
  const locks = palisade.postgresLockManager({ client: db, namespace: 'require', listen: false });
  const earlier = await locks.acquire('job', { ttlMs: 5000 });
  await earlier.release();
  const lease = await locks.acquire('job', { ttlMs: 5000 });
  const repo = palisade.fencedRepository(db, jobs);
  const first = await repo.upsert({ id: 'a', state: 'done' }, lease.fence);
  const late = await repo.update({ id: 'a' }, earlier.fence, { state: 'late' });
  await lease.release();
  await client.close();
  let api = 'present';
  try { require.resolve('@opentelemetry/api'); } catch { api = 'absent'; }
  console.log([first.status, late.status, api].join(' '));
})().catch((err) => { console.error(err); process.exit(1); });
`;

// Makes '@opentelemetry/api' unresolvable, as in an application that did not install the optional peer.
const WITHOUT_API = `
const Module = require('node:module');
const original = Module._resolveFilename;
Module._resolveFilename = function (request, ...rest) {
  if (request === '@opentelemetry/api') {
    const err = new Error("Cannot find module '@opentelemetry/api'");
    err.code = 'MODULE_NOT_FOUND';
    throw err;
  }
  return original.call(this, request, ...rest);
};
`;

describe('the built package under require()', () => {
  beforeAll(async () => {
    mkdirSync(dir, { recursive: true });
    await run(
      process.execPath,
      [resolve('node_modules/typescript/bin/tsc'), '-p', 'tsconfig.build.json', '--outDir', join(dir, 'dist')],
      {
        timeout: 240_000,
      },
    );
    cpSync('drizzle', join(dir, 'drizzle'), { recursive: true }); // migrations ship beside dist/
    writeFileSync(join(dir, 'cycle.cjs'), SCRIPT);
    writeFileSync(join(dir, 'without-api.cjs'), WITHOUT_API);
  }, 300_000);
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('require() loads it and a lock cycle and writes work (api installed, no SDK registered)', async () => {
    const { stdout } = await run(process.execPath, [join(dir, 'cycle.cjs'), join(dir, 'dist', 'index.js')], {
      timeout: 120_000,
    });
    expect(stdout.trim()).toBe('applied stale present');
  });

  it('works with @opentelemetry/api not installed: every hook is a no-op', async () => {
    const { stdout } = await run(
      process.execPath,
      ['--require', join(dir, 'without-api.cjs'), join(dir, 'cycle.cjs'), join(dir, 'dist', 'index.js')],
      { timeout: 120_000 },
    );
    expect(stdout.trim()).toBe('applied stale absent');
  });
});
