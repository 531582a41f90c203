/**
 * The fence trigger against objects a writer planted in `public` before the
 * install, searched: a random set of operators and functions whose argument
 * types match the install's or the trigger's calls better than the catalog's
 * (each answering true, or false; each failing when a superuser calls it,
 * so that one run as the installer fails the install), a random key type,
 * then a superuser's install and the writer's statements with `public` first
 * on its path. The install must succeed; lowering a fence and changing a key
 * must be refused; a tombstone's delete must raise the table's floor to its
 * fence. (README, "Adding fencing to an existing table".)
 */
import { fc } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute, int8 } from '../../src/driver.js';
import { installFenceTrigger } from '../../src/schema/fence-trigger.js';
import { pgliteDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

/** Signatures whose exact match the catalog lacks (or that shadow it first on a writer's path). */
const OPERATORS = [
  ['=', 'varchar', 'varchar'],
  ['=', 'oid', 'regclass'],
  ['=', 'regclass', 'regclass'],
  ['=', 'text', 'text'],
  ['=', 'bigint', 'bigint'],
  ['<', 'bigint', 'bigint'],
  ['<=', 'bigint', 'bigint'],
] as const;
const FUNCTIONS = [
  'format(text, name, name, name)',
  'format(text, name, name, name, text)',
  'format(text, regrole)',
  'format(text, text, text, text, text, text)',
  'concat_ws(text, text, text)',
] as const;
const KEY_TYPES = ['integer', 'text', 'varchar(10)', 'char(3)'] as const;

const scenario = fc.record({
  operators: fc
    .subarray(OPERATORS.map((_, i) => i))
    .chain((picked) =>
      fc.tuple(fc.constant(picked), fc.array(fc.boolean(), { minLength: picked.length, maxLength: picked.length })),
    ),
  functions: fc.subarray([...FUNCTIONS]),
  key: fc.constantFrom(...KEY_TYPES),
});

const ROOT_ONLY =
  "if (select rolsuper from pg_catalog.pg_roles where rolname operator(pg_catalog.=) current_user) then raise exception 'a planted function ran as the installer'; end if;";
let runs = 0;

async function play(db: Database, s: typeof scenario extends fc.Arbitrary<infer T> ? T : never): Promise<void> {
  const n = ++runs;
  const writer = `planter_${process.pid}_${n}`;
  const table = `planted_${n}`;
  const run = (text: string, on: Database = db) => execute(on, sql.raw(text));
  const key = (v: number) => (s.key === 'integer' ? String(v) : `'k${v}'`);
  const asWriter = (statement: string) =>
    db.transaction(async (tx) => {
      const t = tx as unknown as Database;
      await run(`set local role ${writer}`, t);
      await run('set local search_path = public, pg_catalog', t);
      await run(statement, t);
    });
  /** Read with pg_catalog alone on the path: the planted objects must not answer the test's own checks. */
  const read = (text: string) =>
    db.transaction(async (tx) => {
      await run('set local search_path = pg_catalog', tx as unknown as Database);
      return run(text, tx as unknown as Database);
    });
  await run(
    `create table public.${table} (id ${s.key} primary key, last_fence bigint not null default 0, deleted_at timestamptz)`,
  );
  await run(`create role ${writer}`);
  try {
    await run(`grant usage, create on schema public to ${writer}`);
    await run(`grant select, update, delete on public.${table} to ${writer}`);
    await run(`grant usage on schema palisade to ${writer}`);
    await run(`grant select, insert, update on palisade.tombstone_floors to ${writer}`);
    const [picked, answers] = s.operators;
    for (const [i, at] of picked.entries()) {
      const [op, left, right] = OPERATORS[at] as (typeof OPERATORS)[number];
      const fn = `public.${writer}_op${at}`;
      await asWriter(
        `create function ${fn}(${left}, ${right}) returns boolean language plpgsql as $$ begin ${ROOT_ONLY} return ${answers[i]}; end $$`,
      );
      await asWriter(`create operator public.${op} (leftarg = ${left}, rightarg = ${right}, function = ${fn})`);
    }
    for (const signature of s.functions) {
      await asWriter(
        `create function public.${signature} returns text language plpgsql as $$ begin ${ROOT_ONLY} return ''; end $$`,
      );
    }
    await db.transaction((tx) => installFenceTrigger(tx, { name: table, schema: 'public' }));
    await run(`insert into public.${table} (id, last_fence) values (${key(1)}, 10)`);
    await run(`insert into public.${table} (id, last_fence, deleted_at) values (${key(2)}, 20, now())`);
    const where = (v: number) => `id::text operator(pg_catalog.=) ${key(v)}::text`;
    for (const statement of [
      `update public.${table} set last_fence = 1 where ${where(1)}`,
      `update public.${table} set id = ${key(3)}, last_fence = 11 where ${where(1)}`,
    ]) {
      const refused = await asWriter(statement).then(
        () => false,
        () => true,
      );
      expect(refused, statement).toBe(true);
    }
    const deleted = await asWriter(`delete from public.${table} where ${where(2)}`).then(
      () => true,
      () => false,
    );
    const rows = await read(`select id::text as id, last_fence from public.${table} order by 1`);
    expect(rows.map((r) => int8(r.last_fence))).toEqual(deleted ? [10n] : [10n, 20n]);
    const [floor] = await read(
      `select floor from palisade.tombstone_floors where fenced_table operator(pg_catalog.=) 'public.${table}'::regclass`,
    );
    if (deleted) expect(int8(floor?.floor)).toBeGreaterThanOrEqual(20n);
  } finally {
    await run(`drop table if exists public.${table}`).catch(() => {});
    await run(`drop owned by ${writer}`).catch(() => {});
    await run(`drop role ${writer}`);
  }
}

const suites = [
  { name: 'pglite', open: () => pgliteDatabase({ migrated: true }), enabled: true },
  { name: 'postgres', open: () => postgresDatabase({ migrated: true }), enabled: needs('DATABASE_URL') },
];

for (const suite of suites) {
  describe.runIf(suite.enabled)(`fence trigger beside objects a writer planted in public (${suite.name})`, () => {
    let test: TestDatabase;
    beforeAll(async () => {
      test = await suite.open();
    });
    afterAll(async () => {
      await test?.close();
    });

    it(
      'installs untouched by them, and refuses what it refuses without them',
      async () => {
        await fc.assert(
          fc.asyncProperty(scenario, (s) => play(test.db, s)),
          propertyParams({ numRuns: propertyRuns(60) }),
        );
      },
      propertyTimeout(600_000),
    );
  });
}
