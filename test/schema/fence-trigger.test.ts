/**
 * The fence trigger: writers that bypass palisade (a plain UPDATE from psql
 * or another service) are refused by Postgres itself, while every write of a
 * fenced repository — updates, upserts, tombstone deletes, purges — passes.
 */
import { sql } from 'drizzle-orm';
import { integer, pgSchema, pgTable } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute, int8 } from '../../src/driver.js';
import { DatabaseError, InvalidArgumentError } from '../../src/errors.js';
import { toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import {
  dropFenceTriggerStatements,
  FENCE_TRIGGER_SQLSTATE,
  fenceTriggerSql,
  fenceTriggerStatements,
  installFenceTrigger,
} from '../../src/schema/fence-trigger.js';
import { pgliteDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { outcomeOrStillWaiting, until, waitingForLock } from '../support/still-waiting.js';

const f = (n: number) => toFence(n);
let tableCount = 0;

/** The columns of every table here, as SQL, and the drizzle table of that shape named `name`. */
const COLUMNS =
  'id integer primary key, stock integer not null, last_fence bigint not null default 0, deleted_at timestamptz';
const gadgets = (name: string) =>
  pgTable(name, { id: integer('id').primaryKey(), stock: integer('stock').notNull(), ...fenceColumns() });

/** A fresh fenced table of this test's own (one PGlite serves the whole file). */
async function freshTable(db: Database) {
  const name = `gadgets_${++tableCount}`;
  await execute(db, sql.raw(`create table ${name} (${COLUMNS})`));
  return { name, table: gadgets(name) };
}

async function refusal(db: Database, query: string): Promise<DatabaseError> {
  const error = await execute(db, sql.raw(query)).then(
    () => undefined,
    (e: unknown) => e,
  );
  expect(error).toBeInstanceOf(DatabaseError);
  expect((error as DatabaseError).sqlState).toBe(FENCE_TRIGGER_SQLSTATE);
  return error as DatabaseError;
}

async function row(db: Database, name: string, id = 1) {
  const [r] = await execute(
    db,
    sql.raw(`select stock, last_fence, deleted_at is not null as deleted from ${name} where id = ${id}`),
  );
  return r ? { stock: Number(r.stock), fence: int8(r.last_fence), deleted: r.deleted === true } : undefined;
}

const run = (db: Database, text: string) => execute(db, sql.raw(text));

/** Runs statements in one transaction as the writer role, with its own schema first on its search path. */
type AsWriter = (statements: string[]) => Promise<void>;

/**
 * A role of this test's own for `body`, which gets its name and a way to run statements as it; afterwards
 * its schemas (`<role>`, `<role>_app`), what it owns and its grants are dropped, and the role.
 */
async function withWriter(db: Database, body: (writer: string, asWriter: AsWriter) => Promise<void>): Promise<void> {
  const writer = `fence_writer_${process.pid}_${++tableCount}`;
  const asWriter: AsWriter = (statements) =>
    db.transaction(async (tx) => {
      const t = tx as unknown as Database;
      await run(t, `set local role ${writer}`);
      await run(t, `set local search_path = ${writer}, pg_catalog, public`);
      for (const statement of statements) await run(t, statement);
    });
  await run(db, `create role ${writer}`);
  const outcome = await body(writer, asWriter).then(
    () => undefined,
    (e: unknown) => ({ failed: e }),
  );
  // Every step, even after one failed (a failed test may leave the writer's objects half made): the role
  // outlives the test's database otherwise. The test's own failure is the one reported.
  let cleanup: unknown;
  for (const statement of [
    `drop schema if exists ${writer}, ${writer}_app cascade`,
    `drop owned by ${writer}`,
    `drop role ${writer}`,
  ]) {
    await run(db, statement).catch((e: unknown) => {
      cleanup ??= e;
    });
  }
  if (outcome) throw outcome.failed;
  if (cleanup !== undefined) throw cleanup;
}

/** `statement`, run as the writer after `before`, is refused by the fence trigger. */
async function refusedAs(asWriter: AsWriter, statement: string, before: string[] = []): Promise<void> {
  const error = await asWriter([...before, statement]).then(
    () => undefined,
    (e: unknown) => e,
  );
  expect(error, statement).toBeInstanceOf(DatabaseError);
  expect((error as DatabaseError).sqlState, statement).toBe(FENCE_TRIGGER_SQLSTATE);
}

const suites = [
  { name: 'pglite', open: pgliteDatabase, enabled: true },
  { name: 'postgres', open: postgresDatabase, enabled: needs('DATABASE_URL') },
];

for (const suite of suites) {
  describe.runIf(suite.enabled)(`fence trigger (${suite.name})`, () => {
    let test: TestDatabase;
    beforeAll(async () => {
      test = await suite.open();
      // Upserts read palisade's tombstone floor.
      await migrate(test.db);
    });
    afterAll(async () => {
      await test?.close();
    });

    it('without the trigger a plain UPDATE lands (the hole it closes)', async () => {
      const { name } = await freshTable(test.db);
      await execute(test.db, sql.raw(`insert into ${name} (id, stock, last_fence) values (1, 5, 7)`));
      await execute(test.db, sql.raw(`update ${name} set stock = 1`));
      expect(await row(test.db, name)).toEqual({ stock: 1, fence: 7n, deleted: false });
    });

    it('refuses UPDATEs that keep or lower last_fence, from any writer', async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      await installFenceTrigger(test.db, table); // idempotent
      const repo = fencedRepository(test.db, table);
      expect((await repo.upsert({ id: 1, stock: 5 }, f(3))).status).toBe('applied');

      const error = await refusal(test.db, `update ${name} set stock = 1`);
      expect(error.message).toMatch(
        new RegExp(`unfenced update of public\\.${name} refused: last_fence must rise above 3`),
      );
      await refusal(test.db, `update ${name} set stock = 1, last_fence = 2`);
      await refusal(test.db, `update ${name} set deleted_at = now()`);
      expect(await row(test.db, name)).toEqual({ stock: 5, fence: 3n, deleted: false });

      // Documented non-guarantee: a writer that raises the fence itself passes.
      await execute(test.db, sql.raw(`update ${name} set stock = 6, last_fence = last_fence + 1`));
      expect(await row(test.db, name)).toEqual({ stock: 6, fence: 4n, deleted: false });
    });

    it('holds against a writer whose search path puts operators of its own before the catalog', async () => {
      // Found by an attack: the trigger functions ran under the firing session's search path, and a writer with
      // a schema of its own (CREATE on public, the default before Postgres 15) chose their operators.
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(50));
      await repo.upsert({ id: 2, stock: 5 }, f(55));
      await repo.delete({ id: 2 }, f(60));
      await withWriter(test.db, async (writer, asWriter) => {
        await run(test.db, `grant select, update, delete on ${name} to ${writer}`);
        await run(test.db, `grant usage on schema palisade to ${writer}`);
        await run(test.db, `grant select, insert, update on palisade.tombstone_floors to ${writer}`);
        await run(test.db, `create schema ${writer} authorization ${writer}`);
        await asWriter([
          `create function ${writer}.never(bigint, bigint) returns boolean language sql immutable as 'select false'`,
          ...['<', '<=', '='].map(
            (op) => `create operator ${writer}.${op} (leftarg = bigint, rightarg = bigint, function = ${writer}.never)`,
          ),
          `create function ${writer}.same(a text, b text) returns boolean language sql immutable as
             $$ select a operator(pg_catalog.=) b and b operator(pg_catalog.<>) 'after' and b operator(pg_catalog.<>) 'key' $$`,
          `create operator ${writer}.= (leftarg = text, rightarg = text, function = ${writer}.same)`,
          `create function ${writer}.pg_partition_root(regclass) returns regclass language sql as $$ select 'pg_catalog.pg_class'::regclass $$`,
        ]);
        for (const statement of [
          `update public.${name} set last_fence = 1, stock = 99 where id = 1`,
          `update public.${name} set id = 7, last_fence = 51 where id = 1`,
        ]) {
          await refusedAs(asWriter, statement);
        }
        await asWriter([`delete from public.${name} where deleted_at is not null`]);
      });
      expect(await row(test.db, name, 1)).toEqual({ stock: 5, fence: 50n, deleted: false });
      expect(await repo.update({ id: 1 }, f(20), { stock: 1 })).toEqual({ status: 'stale', currentFence: 50n });
      expect(await repo.upsert({ id: 2, stock: 1 }, f(57))).toEqual({ status: 'stale', currentFence: 60n });
    });

    it("compares the key by its index's own equality, not by an `=` a writer put in public before the install", async () => {
      // Found by an attack: varchar has no `=` of its own in the catalog (it is compared as text), so a
      // writer's public.=(varchar, varchar) matched exactly and was bound into the key guard at the install.
      const name = `lettered_${++tableCount}`;
      await run(
        test.db,
        `create table ${name} (id varchar(40) primary key, stock integer not null default 0,
           last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await withWriter(test.db, async (writer, asWriter) => {
        await run(test.db, `grant usage, create on schema public to ${writer}`);
        await run(test.db, `grant select, update on ${name} to ${writer}`);
        await asWriter([
          `create function public.${writer}_eq(a varchar, b varchar) returns boolean language sql immutable
             as $$ select a::text operator(pg_catalog.=) b::text or current_setting('palisade_test.lie', true) = 'on' $$`,
          `create operator public.= (leftarg = varchar, rightarg = varchar, function = public.${writer}_eq)`,
        ]);
        await installFenceTrigger(test.db, { name });
        await run(test.db, `insert into ${name} (id, last_fence) values ('k', 10)`);
        await refusedAs(asWriter, `update ${name} set id = 'k2', last_fence = 11 where id::text = 'k'`, [
          "set local palisade_test.lie = 'on'",
        ]);
      });
      const rows = await run(test.db, `select id, last_fence from ${name}`);
      expect(rows.map((r) => [r.id, int8(r.last_fence)])).toEqual([['k', 10n]]);
    });

    it('installs the same guard whatever a writer put in public before: an `=(oid, regclass)`, a `format` of its own', async () => {
      // Found by an attack: the install's own statements resolved through the installer's search path, where a
      // writer's better-matching `=` emptied the key guard (none installed) and its `format` ran as the installer.
      const name = `planted_${++tableCount}`;
      await run(
        test.db,
        `create table ${name} (id text primary key, stock integer not null default 0,
           last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await withWriter(test.db, async (writer, asWriter) => {
        await run(test.db, `grant usage, create on schema public to ${writer}`);
        await run(test.db, `grant select, update on ${name} to ${writer}`);
        const planted = "language plpgsql as $$ begin raise exception 'a planted function ran'; end $$";
        await asWriter([
          `create function public.${writer}_never(oid, regclass) returns boolean language sql immutable as 'select false'`,
          `create operator public.= (leftarg = oid, rightarg = regclass, function = public.${writer}_never)`,
          `create function public.format(text, name, name, name, text) returns text ${planted}`,
          `create function public.format(text, name, name, name) returns text ${planted}`,
          `create function public.format(text, text, text, text, text, text) returns text ${planted}`,
          `create function public.concat_ws(text, text, text) returns text ${planted}`,
        ]);
        await test.db.transaction((tx) => installFenceTrigger(tx, { name }));
        const guards = await run(
          test.db,
          `select tgname from pg_trigger where tgrelid::oid operator(pg_catalog.=) '${name}'::regclass::oid and not tgisinternal order by 1`,
        );
        expect(guards.map((r) => r.tgname)).toContain('~palisade_fence_guard_key');
        await run(test.db, `insert into ${name} (id, last_fence) values ('k', 10)`);
        await refusedAs(asWriter, `update public.${name} set id = 'k2', last_fence = last_fence + 1 where id = 'k'`);
      });
    });

    it.runIf(suite.name === 'postgres')(
      "compares a domain key by its base type's equality, not by a writer's `=` for the domain",
      async () => {
        // Found by an attack: OPERATOR(public.=) on a domain over citext bound the writer's =(domain, domain).
        const extension = await run(test.db, 'create extension if not exists citext').then(
          () => true,
          () => false, // no contrib here: nothing to check
        );
        if (!extension) return;
        const name = `mailed_${++tableCount}`;
        await run(test.db, `create domain ${name}_email as public.citext`);
        await run(
          test.db,
          `create table ${name} (id ${name}_email primary key, stock integer not null default 0,
             last_fence bigint not null default 0, deleted_at timestamptz)`,
        );
        await withWriter(test.db, async (writer, asWriter) => {
          await run(test.db, `grant usage, create on schema public to ${writer}`);
          await run(test.db, `grant select, update on ${name} to ${writer}`);
          await asWriter([
            `create function public.${writer}_same(${name}_email, ${name}_email) returns boolean language sql
               immutable as 'select true'`,
            `create operator public.= (leftarg = ${name}_email, rightarg = ${name}_email, function = public.${writer}_same)`,
          ]);
          await test.db.transaction((tx) => installFenceTrigger(tx, { name }));
          await run(test.db, `insert into ${name} (id, last_fence) values ('k@x', 10)`);
          await refusedAs(asWriter, `update ${name} set id = 'moved@y', last_fence = 11 where id::text = 'k@x'`);
          // A case change is no key change under citext's equality.
          await asWriter([`update ${name} set id = 'K@X', last_fence = 12 where id::text = 'k@x'`]);
        });
        await run(test.db, `drop table ${name}`);
        await run(test.db, `drop domain ${name}_email`);
      },
    );

    it('guards a char(n) or bit(n) key whole, not by its first character or bit', async () => {
      // Found by an attack on a cast to the equality's input type written without a length: char meant char(1).
      for (const [type, from, to] of [
        ['char(3)', "'abc'", "'axy'"],
        ['bit(8)', "B'10101010'", "B'11111111'"],
      ] as const) {
        const name = `coded_${++tableCount}`;
        await run(
          test.db,
          `create table ${name} (id ${type} primary key, last_fence bigint not null default 0, deleted_at timestamptz)`,
        );
        await installFenceTrigger(test.db, { name });
        await run(test.db, `insert into ${name} (id, last_fence) values (${from}, 10)`);
        await refusal(test.db, `update ${name} set id = ${to}, last_fence = 11 where id = ${from}`);
      }
    });

    it("the ownership check's refusal runs no function a writer put in public", async () => {
      // Found by an attack: its message's format(text, regrole) matched a writer's public.format better.
      await withWriter(test.db, async (writer, asWriter) => {
        const schema = `${writer}_app`;
        await run(test.db, `create schema ${schema}`);
        await run(test.db, `grant usage, create on schema ${schema}, public to ${writer}`);
        await run(test.db, `create table ${schema}.accounts (${COLUMNS})`);
        await asWriter([
          `create function ${schema}.palisade_fence_guard() returns trigger language plpgsql as $$ begin return null; end $$`,
          `create function public.format(text, regrole) returns text language plpgsql
             as $$ begin raise exception 'a planted function ran'; end $$`,
        ]);
        const error = await test.db
          .transaction((tx) => installFenceTrigger(tx, { schema, name: 'accounts' }))
          .then(
            () => undefined,
            (e: unknown) => e,
          );
        expect((error as DatabaseError).sqlState).toBe('42501');
      });
    });

    it("an upsert reads the table's floor whatever `=` a writer put in public", async () => {
      // Found by an attack: regclass has no `=` of its own in the catalog, and a writer's public.=(regclass,
      // regclass) hid the floor from palisade's upsert, which recreated a purged key at a stale fence.
      const { name, table } = await freshTable(test.db);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(10));
      await repo.delete({ id: 1 }, f(11));
      expect(await repo.purgeTombstones(new Date(Date.now() + 3_600_000))).toBe(1);
      await withWriter(test.db, async (writer, asWriter) => {
        await run(test.db, `grant usage, create on schema public to ${writer}`);
        await asWriter([
          `create function public.${writer}_never(regclass, regclass) returns boolean language sql immutable as 'select false'`,
          `create operator public.= (leftarg = regclass, rightarg = regclass, function = public.${writer}_never)`,
        ]);
        expect(await repo.upsert({ id: 1, stock: 666 }, f(5))).toEqual({ status: 'stale', currentFence: 11n });
      });
      expect(await row(test.db, name, 1)).toBeUndefined();
    });

    it('refuses to install over functions of its names that a writer made first (their owner could change them)', async () => {
      // Found by an attack: CREATE OR REPLACE by a superuser kept the writer as the functions' owner.
      await withWriter(test.db, async (writer, asWriter) => {
        const schema = `${writer}_app`;
        await run(test.db, `create schema ${schema}`);
        await run(test.db, `grant usage, create on schema ${schema} to ${writer}`);
        await run(test.db, `create table ${schema}.accounts (${COLUMNS})`);
        await asWriter([
          `create function ${schema}.palisade_fence_guard() returns trigger language plpgsql as $$ begin return null; end $$`,
        ]);
        const error = await test.db
          .transaction((tx) => installFenceTrigger(tx, { schema, name: 'accounts' }))
          .then(
            () => undefined,
            (e: unknown) => e,
          );
        expect(error).toBeInstanceOf(DatabaseError);
        expect((error as DatabaseError).sqlState).toBe('42501');
        expect((error as DatabaseError).message).toContain("the fence trigger's functions exist, owned by");
        const [fn] = await run(
          test.db,
          `select p.proowner::regrole::text as owner, p.prosrc from pg_catalog.pg_proc p
            where p.oid = to_regprocedure('${schema}.palisade_fence_guard()')`,
        );
        expect(fn?.owner).toBe(writer);
        expect(String(fn?.prosrc)).toContain('return null');
      });
    });

    it("takes a fence the table's own trigger sets at its word while it rises (documented: leave last_fence to palisade)", async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(3));
      await execute(
        test.db,
        sql.raw(`create function ${name}_version() returns trigger language plpgsql as $$ begin
          NEW.last_fence := OLD.last_fence + 1; return NEW; end $$`),
      );
      await execute(
        test.db,
        sql.raw(`create trigger a_version before update on ${name} for each row execute function ${name}_version()`),
      );
      // Holder 10 wrote, but the row says 4: holder 7, older than 10, writes after it.
      expect((await repo.update({ id: 1 }, f(10), { stock: 6 })).status).toBe('applied');
      expect(await row(test.db, name)).toEqual({ stock: 6, fence: 4n, deleted: false });
      expect((await repo.update({ id: 1 }, f(7), { stock: 7 })).status).toBe('applied');
    });

    it("lets every fenced repository write through, and still reports stale writes as 'stale'", async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      expect((await repo.upsert({ id: 1, stock: 5 }, f(1))).status).toBe('applied');
      expect((await repo.upsert({ id: 1, stock: 6 }, f(2))).status).toBe('applied'); // ON CONFLICT DO UPDATE
      expect((await repo.update({ id: 1 }, f(5), { stock: 7 })).status).toBe('applied');
      expect(await repo.update({ id: 1 }, f(4), { stock: 99 })).toEqual({ status: 'stale', currentFence: 5n });
      expect(await repo.update({ id: 1 }, f(5), { stock: 99 })).toEqual({ status: 'duplicate' });
      expect((await repo.modify({ id: 1 }, f(6), (r) => ({ stock: r.stock + 1 }))).status).toBe('applied');
      expect(await repo.updateWhere(sql`true`, f(7), { stock: sql`${table.stock} + 1` })).toEqual({
        applied: 1,
        stale: 0,
      });
      expect(await row(test.db, name)).toEqual({ stock: 9, fence: 7n, deleted: false });

      // Deletes leave a tombstone: allowed; an update finds no live row and writes nothing; a stale upsert
      // cannot resurrect it.
      expect((await repo.delete({ id: 1 }, f(8))).status).toBe('applied');
      expect(await repo.update({ id: 1 }, f(9), { stock: 1 })).toEqual({ status: 'missing' });
      expect(await row(test.db, name)).toEqual({ stock: 9, fence: 8n, deleted: true });
      expect(await repo.upsert({ id: 1, stock: 1 }, f(7))).toEqual({ status: 'stale', currentFence: 8n });
      expect((await repo.upsert({ id: 1, stock: 2 }, f(10))).status).toBe('applied');
      expect(await row(test.db, name)).toEqual({ stock: 2, fence: 10n, deleted: false });
    });

    it('refuses a DELETE of a live row but lets tombstones be purged', async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(1));
      await repo.upsert({ id: 2, stock: 5 }, f(1));
      const error = await refusal(test.db, `delete from ${name} where id = 1`);
      expect(error.message).toMatch(/delete of a live row of .* refused/);
      expect(await row(test.db, name)).toEqual({ stock: 5, fence: 1n, deleted: false });

      expect((await repo.delete({ id: 1 }, f(2))).status).toBe('applied');
      expect(await repo.purgeTombstones(new Date(Date.now() + 3_600_000))).toBe(1);
      expect(await row(test.db, name, 1)).toBeUndefined();
      expect(await row(test.db, name, 2)).toEqual({ stock: 5, fence: 1n, deleted: false });
    });

    it("a DELETE of tombstones from any writer raises the table's floor: a stale upsert cannot recreate the row", async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(10));
      await repo.upsert({ id: 2, stock: 5 }, f(10));
      expect((await repo.delete({ id: 1 }, f(20))).status).toBe('applied');
      expect((await repo.delete({ id: 2 }, f(12))).status).toBe('applied');
      // An operator's cleanup, or another service, bypassing purgeTombstones.
      await execute(test.db, sql.raw(`delete from ${name} where deleted_at is not null`));
      expect(await row(test.db, name)).toBeUndefined();
      expect(await repo.upsert({ id: 1, stock: 1 }, f(15))).toEqual({ status: 'stale', currentFence: 20n });
      expect(await repo.upsert({ id: 3, stock: 1 }, f(19))).toEqual({ status: 'stale', currentFence: 20n });
      expect(await row(test.db, name)).toBeUndefined();
      // A statement that removed nothing leaves the floor where it was; a purge's own raise and the trigger's agree.
      await execute(test.db, sql.raw(`delete from ${name} where deleted_at is not null`));
      expect((await repo.upsert({ id: 1, stock: 2 }, f(21))).status).toBe('applied');
      expect((await repo.delete({ id: 1 }, f(22))).status).toBe('applied');
      expect(await repo.purgeTombstones(new Date(Date.now() + 3_600_000))).toBe(1);
      expect(await repo.upsert({ id: 1, stock: 3 }, f(21))).toEqual({ status: 'stale', currentFence: 22n });
    });

    it("a DELETE of tombstones through a partition's own name, at any level of the tree, raises the table's floor", async () => {
      const name = `parts_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by range (id)`));
      await execute(test.db, sql.raw(`create table ${name}_low partition of ${name} for values from (0) to (10)`));
      await execute(
        test.db,
        sql.raw(`create table ${name}_high partition of ${name} for values from (10) to (100) partition by range (id)`),
      );
      await execute(
        test.db,
        sql.raw(`create table ${name}_high_a partition of ${name}_high for values from (10) to (100)`),
      );
      const table = gadgets(name);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      const tombstone = async (id: number, fence: number) => {
        await execute(test.db, sql.raw(`insert into ${name} (id, stock) values (${id}, 1)`));
        expect((await repo.delete({ id }, f(fence))).status).toBe('applied');
      };
      // Through a leaf, an intermediate partition and a leaf below it: each statement names a partition, whose
      // floor trigger raises the floor of the whole tree.
      await tombstone(1, 30);
      await execute(test.db, sql.raw(`delete from ${name}_low where id = 1`));
      expect(await repo.upsert({ id: 1, stock: 2 }, f(29))).toEqual({ status: 'stale', currentFence: 30n });
      await tombstone(11, 40);
      await execute(test.db, sql.raw(`delete from ${name}_high where id = 11`));
      expect(await repo.upsert({ id: 11, stock: 2 }, f(39))).toEqual({ status: 'stale', currentFence: 40n });
      await tombstone(12, 50);
      await execute(test.db, sql.raw(`delete from ${name}_high_a where id = 12`));
      expect(await repo.upsert({ id: 12, stock: 2 }, f(49))).toEqual({ status: 'stale', currentFence: 50n });
      expect(await row(test.db, name, 12)).toBeUndefined();
      // A live row is refused through a partition as through the parent.
      await execute(test.db, sql.raw(`insert into ${name} (id, stock) values (2, 1)`));
      await refusal(test.db, `delete from ${name}_low where id = 2`);
    });

    it('a partition that joined the table after the install raises the floor row by row, until the install runs again', async () => {
      const name = `late_parts_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by list (id)`));
      await execute(test.db, sql.raw(`create table ${name}_1 partition of ${name} for values in (1)`));
      const table = gadgets(name);
      await installFenceTrigger(test.db, table);
      // Postgres gives the new partitions the row triggers, not the statement triggers that raise the floor.
      for (const id of [2, 3]) {
        await execute(test.db, sql.raw(`create table ${name}_${id} partition of ${name} for values in (${id})`));
      }
      const repo = fencedRepository(test.db, table);
      for (const [id, fence] of [
        [2, 20],
        [3, 30],
      ] as const) {
        await execute(test.db, sql.raw(`insert into ${name} (id, stock) values (${id}, 1)`));
        expect((await repo.delete({ id }, f(fence))).status).toBe('applied');
      }
      await execute(test.db, sql.raw(`delete from ${name}_2 where id = 2`));
      expect(await repo.upsert({ id: 2, stock: 2 }, f(19))).toEqual({ status: 'stale', currentFence: 20n });
      // Inside a statement of a table that has them (a function run by the DELETE's WHERE) as well.
      await execute(
        test.db,
        sql.raw(`create function ${name}_sweep() returns boolean language plpgsql as $$
          begin delete from ${name}_3 where id = 3; return true; end $$`),
      );
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at) values (1, 1, 5, now())`),
      );
      await execute(test.db, sql.raw(`delete from ${name}_1 where ${name}_sweep() and id = 1`));
      expect([await row(test.db, name, 1), await row(test.db, name, 3)]).toEqual([undefined, undefined]);
      expect(await repo.upsert({ id: 3, stock: 2 }, f(29))).toEqual({ status: 'stale', currentFence: 30n });
      await installFenceTrigger(test.db, table);
      expect(await repo.upsert({ id: 2, stock: 3 }, f(31))).toMatchObject({ status: 'applied' });
      expect((await repo.delete({ id: 2 }, f(40))).status).toBe('applied');
      await execute(test.db, sql.raw(`delete from ${name}_2 where id = 2`));
      expect(await repo.upsert({ id: 2, stock: 4 }, f(39))).toEqual({ status: 'stale', currentFence: 40n });
    });

    it("refuses an UPDATE of a row's primary key, which would leave the old key without its fence", async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(10));
      await repo.upsert({ id: 2, stock: 5 }, f(10));
      expect((await repo.delete({ id: 2 }, f(12))).status).toBe('applied');
      // Raising the fence does not make it a fenced write: a live row and a tombstone alike.
      await refusal(test.db, `update ${name} set id = 100, last_fence = last_fence + 1 where id = 1`);
      await refusal(test.db, `update ${name} set id = 200, last_fence = last_fence + 1 where id = 2`);
      await refusal(
        test.db,
        `merge into ${name} t using (select 2 as k) s on t.id = s.k
           when matched then update set id = 300, last_fence = t.last_fence + 1`,
      );
      expect(await row(test.db, name, 1)).toEqual({ stock: 5, fence: 10n, deleted: false });
      expect(await repo.upsert({ id: 2, stock: 1 }, f(11))).toEqual({ status: 'stale', currentFence: 12n });
      // The same key written back is no change.
      await execute(test.db, sql.raw(`update ${name} set id = 1, stock = 6, last_fence = 11 where id = 1`));
      expect(await row(test.db, name, 1)).toEqual({ stock: 6, fence: 11n, deleted: false });
    });

    it('refuses an UPDATE that would move a row to another partition (a new key)', async () => {
      const name = `moving_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by range (id)`));
      await execute(test.db, sql.raw(`create table ${name}_lo partition of ${name} for values from (0) to (100)`));
      await execute(test.db, sql.raw(`create table ${name}_hi partition of ${name} for values from (100) to (1000)`));
      const table = gadgets(name);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 5, stock: 1 }, f(5));
      expect((await repo.delete({ id: 5 }, f(10))).status).toBe('applied');
      await refusal(test.db, `update ${name} set id = 500, last_fence = last_fence + 1 where id = 5`);
      await refusal(test.db, `update ${name}_lo set id = 50, last_fence = last_fence + 1 where id = 5`);
      expect(await repo.upsert({ id: 5, stock: 2 }, f(7))).toEqual({ status: 'stale', currentFence: 10n });
    });

    it("refuses a key change the table's own BEFORE trigger makes, also where the row moves to another partition", async () => {
      // Found by attacks: a trigger sorting after palisade's key guard changed a tombstone's key, the row moved
      // to another partition (a delete and an insert: no AFTER UPDATE check) and the delete raised the floor
      // only to the row's fence before the update — a stale upsert recreated the old key. A note of the row
      // the update guard passed, told from a delete by the delete trigger, was then defeated by a write nested
      // between the two, a time zone set in between, and a partition fenced before it was attached; and it
      // refused a plain tombstone DELETE beside an UPDATE in one statement. The key guard now runs last.
      const name = `archived_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by range (id)`));
      await execute(test.db, sql.raw(`create table ${name}_live partition of ${name} for values from (0) to (1000)`));
      await execute(test.db, sql.raw(`create table ${name}_old partition of ${name} for values from (1000) to (2000)`));
      // Fenced on its own before it joins the tree, as the attack's third way did.
      await execute(test.db, sql.raw(`create table ${name}_late (${COLUMNS})`));
      await installFenceTrigger(test.db, { name: `${name}_late` });
      await execute(
        test.db,
        sql.raw(`alter table ${name} attach partition ${name}_late for values from (2000) to (3000)`),
      );
      const table = gadgets(name);
      await installFenceTrigger(test.db, { name: `${name}_live` });
      await execute(
        test.db,
        sql.raw(`create function ${name}_archive() returns trigger language plpgsql as $$ begin
          -- Another tombstone written first (it overwrote the old note), in another time zone.
          if OLD.id <> 1999 then update ${name} set last_fence = last_fence + 1 where id = 1999; end if;
          set local timezone = 'Asia/Kathmandu';
          if OLD.deleted_at is not null and NEW.id < 1000 then NEW.id := NEW.id + 1000; end if;
          if OLD.deleted_at is not null and NEW.id >= 2000 then NEW.id := NEW.id - 1900; end if;
          return NEW; end $$`),
      );
      await execute(
        test.db,
        sql.raw(`create trigger zz_archive before update on ${name} for each row execute function ${name}_archive()`),
      );
      const repo = fencedRepository(test.db, table);
      for (const id of [1999, 2, 3, 4, 2005]) {
        await repo.upsert({ id, stock: 1 }, f(10));
        expect((await repo.delete({ id }, f(20))).status).toBe('applied');
      }
      // A fence raised by hand, a resurrection by hand, a MERGE, and from the partition fenced before it was
      // attached: all refused. (Through a partition's own name Postgres refuses the row itself.)
      const error = await refusal(test.db, `update ${name} set last_fence = 50 where id = 2`);
      expect(error.message).toContain('update of the primary key');
      await refusal(test.db, `update ${name} set last_fence = 50, deleted_at = null where id = 3`);
      await refusal(
        test.db,
        `merge into ${name} t using (select 4 as k) s on t.id = s.k when matched then update set last_fence = 50`,
      );
      await refusal(test.db, `update ${name} set last_fence = 50 where id = 2005`);
      for (const id of [2, 3, 4, 2005]) {
        expect(await row(test.db, name, id)).toEqual({ stock: 1, fence: 20n, deleted: true });
      }
      expect([await row(test.db, name, 1002), await row(test.db, name, 105)]).toEqual([undefined, undefined]);
      expect(await repo.upsert({ id: 2, stock: 666 }, f(15))).toEqual({ status: 'stale', currentFence: 20n });
      // Without that trigger the same tree lets palisade's writes through, and a tombstone DELETE beside an
      // UPDATE of another tombstone in one statement, or in one transaction.
      await execute(test.db, sql.raw(`drop trigger zz_archive on ${name}`));
      expect(await repo.upsert({ id: 3, stock: 2 }, f(40))).toMatchObject({ status: 'applied' });
      await execute(
        test.db,
        sql.raw(
          `do $$ begin update ${name} set last_fence = 25 where id = 2; delete from ${name} where id = 4; end $$`,
        ),
      );
      await test.db.transaction(async (tx) => {
        const t = tx as unknown as Database;
        await execute(t, sql.raw(`update ${name} set last_fence = 60 where id = 2005`));
        await execute(t, sql.raw(`delete from ${name} where id = 2005`));
      });
      expect([await row(test.db, name, 4), await row(test.db, name, 2005)]).toEqual([undefined, undefined]);
      expect(await repo.upsert({ id: 4, stock: 3 }, f(55))).toEqual({ status: 'stale', currentFence: 60n });
    });

    it("an install over an earlier one drops that one's key guard by its old name", async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      // The key guard as an earlier install named it (it then ran before the table's triggers named after "p…").
      await execute(
        test.db,
        sql.raw(`create trigger palisade_fence_guard_key before update of id on ${name} for each row
          when (OLD.id is distinct from NEW.id) execute function palisade_fence_guard('key')`),
      );
      await installFenceTrigger(test.db, table);
      const names = await execute(
        test.db,
        sql.raw(`select tgname from pg_trigger where tgrelid = '${name}'::regclass and tgname like '%key' order by 1`),
      );
      expect(names.map((r) => r.tgname)).toEqual(['~palisade_fence_guard_key']);
    });

    it.runIf(suite.name === 'postgres')(
      'refuses to install on a tree whose key column is generated in a partition only (Postgres 15 attaches one)',
      async () => {
        // Found by attacks. Left out of the key guard, the column let a tombstone of another partition move when
        // a statement set it (no AFTER UPDATE check fires on a move), and where it is generated a change of its
        // inputs moves the row unseen; kept in it, the guard read NEW of it before Postgres computed it (null)
        // and refused every update there.
        const name = `generated_${++tableCount}`;
        await execute(
          test.db,
          sql.raw(`create table ${name} (id integer not null, g integer not null, v integer not null,
            last_fence bigint not null default 0, deleted_at timestamptz, primary key (id, g)) partition by list (g)`),
        );
        await execute(test.db, sql.raw(`create table ${name}_1 partition of ${name} for values in (1)`));
        await execute(test.db, sql.raw(`create table ${name}_2 partition of ${name} for values in (2)`));
        const attached = await execute(
          test.db,
          sql.raw(`create table ${name}_0 (id integer not null, g integer not null generated always as (v % 2) stored,
            v integer not null, last_fence bigint not null default 0, deleted_at timestamptz)`),
        ).then(() =>
          execute(test.db, sql.raw(`alter table ${name} attach partition ${name}_0 for values in (0)`)).then(
            () => true,
            () => false, // a later Postgres refuses such a partition: nothing to check there
          ),
        );
        if (!attached) return;
        await execute(
          test.db,
          sql.raw(`insert into ${name}_1 (id, g, v, last_fence, deleted_at) values (1, 1, 0, 12, now())`),
        );
        const error = await test.db
          .transaction((tx) => installFenceTrigger(tx, { name }))
          .then(
            () => undefined,
            (e: unknown) => e,
          );
        expect(error).toBeInstanceOf(DatabaseError);
        expect((error as DatabaseError).sqlState).toBe('0A000');
        expect((error as DatabaseError).message).toContain('is generated in a partition and not in the table');
        const triggers = await execute(
          test.db,
          sql.raw(`select count(*)::int as n from pg_trigger where tgrelid = '${name}'::regclass and not tgisinternal`),
        );
        expect(triggers[0]?.n).toBe(0);
      },
    );

    it.runIf(suite.name === 'postgres')(
      'refuses every update of a partition attached after the install whose key column is generated there',
      async () => {
        // Found by an attack on a guard that skipped its function when the fence rose: the key guard then read
        // the column's old value and a tombstone moved out unseen. The guard's function nulls it first.
        const name = `late_generated_${++tableCount}`;
        await run(
          test.db,
          `create table ${name} (id integer not null, g integer not null, v integer not null,
            last_fence bigint not null default 0, deleted_at timestamptz, primary key (id, g)) partition by list (g)`,
        );
        await run(test.db, `create table ${name}_1 partition of ${name} for values in (1)`);
        await installFenceTrigger(test.db, { name });
        await run(
          test.db,
          `create table ${name}_0 (id integer not null, g integer not null generated always as (v % 2) stored,
            v integer not null, last_fence bigint not null default 0, deleted_at timestamptz)`,
        );
        const attached = await run(test.db, `alter table ${name} attach partition ${name}_0 for values in (0)`).then(
          () => true,
          () => false, // a later Postgres refuses such a partition: nothing to check there
        );
        if (!attached) return;
        await run(test.db, `insert into ${name}_0 (id, v, last_fence, deleted_at) values (1, 2, 12, now())`);
        await refusal(test.db, `update ${name} set v = 3, last_fence = 20 where id = 1 and g = 0`);
        await refusal(test.db, `update ${name} set last_fence = 20 where id = 1 and g = 0`);
        const rows = await run(test.db, `select id, g, last_fence from ${name}`);
        expect(rows.map((r) => [r.id, r.g, int8(r.last_fence)])).toEqual([[1, 0, 12n]]);
      },
    );

    it('lets palisade update a table whose primary key INCLUDEs other columns (only key columns are guarded)', async () => {
      // Found by an attack: the key guard read the index's INCLUDE columns as key columns and refused every update.
      const name = `included_${++tableCount}`;
      await execute(
        test.db,
        sql.raw(
          `create table ${name} (id integer, stock integer not null, last_fence bigint not null default 0, deleted_at timestamptz, primary key (id) include (stock))`,
        ),
      );
      const table = gadgets(name);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(10));
      expect(await repo.update({ id: 1 }, f(11), { stock: 6 })).toMatchObject({ status: 'applied' });
      expect(await row(test.db, name, 1)).toEqual({ stock: 6, fence: 11n, deleted: false });
      await refusal(test.db, `update ${name} set id = 2, last_fence = 12 where id = 1`);
    });

    it("a DELETE through an inheritance parent raises each child's own floor", async () => {
      const parent = `stock_all_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${parent} (${COLUMNS})`));
      await execute(test.db, sql.raw(`create table ${parent}_kid (primary key (id)) inherits (${parent})`));
      const kid = gadgets(`${parent}_kid`);
      const parentTable = gadgets(parent);
      // On the child alone, then on both: the parent's own floor trigger must not stand in for the child's.
      for (const installed of [[kid], [kid, parentTable]]) {
        for (const t of installed) await installFenceTrigger(test.db, t);
        const repo = fencedRepository(test.db, kid);
        const id = installed.length;
        await repo.upsert({ id, stock: 1 }, f(10 * id));
        expect((await repo.delete({ id }, f(10 * id + 5))).status).toBe('applied');
        await execute(test.db, sql.raw(`delete from ${parent} where deleted_at is not null`));
        expect(await row(test.db, `${parent}_kid`, id)).toBeUndefined();
        expect(await repo.upsert({ id, stock: 2 }, f(10 * id + 1))).toEqual({
          status: 'stale',
          currentFence: BigInt(10 * id + 5),
        });
      }
    });

    it('DELETEs of two tables in one statement (data-modifying CTEs) leave no floor to a later statement', async () => {
      // Their statement triggers end in no fixed order: a stack of open DELETEs kept the second table's entry,
      // and a later tombstone of it, through its inheritance parent, left its fence to a trigger that never ran.
      const one = await freshTable(test.db);
      const parent = `cte_parent_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${parent} (${COLUMNS})`));
      await execute(test.db, sql.raw(`create table ${parent}_kid (primary key (id)) inherits (${parent})`));
      const kid = gadgets(`${parent}_kid`);
      await installFenceTrigger(test.db, one.table);
      await installFenceTrigger(test.db, kid);
      await execute(
        test.db,
        sql.raw(`insert into ${one.name} (id, stock, last_fence, deleted_at) values (1, 1, 5, now())`),
      );
      await execute(
        test.db,
        sql.raw(
          `insert into ${parent}_kid (id, stock, last_fence, deleted_at) values (1, 1, 10, now()), (2, 1, 20, now())`,
        ),
      );
      await test.db.transaction(async (tx) => {
        const t = tx as unknown as Database;
        await execute(
          t,
          sql.raw(`with a as (delete from ${one.name} where id = 1) delete from ${parent}_kid where id = 1`),
        );
        await execute(t, sql.raw(`delete from ${parent} where id = 2`));
      });
      const repo = fencedRepository(test.db, kid);
      expect(await repo.upsert({ id: 2, stock: 2 }, f(15))).toEqual({ status: 'stale', currentFence: 20n });
      expect(await fencedRepository(test.db, one.table).upsert({ id: 1, stock: 2 }, f(4))).toEqual({
        status: 'stale',
        currentFence: 5n,
      });
    });

    it('purgeTombstones goes through a partition made after the install and through an inheritance parent', async () => {
      const name = `late_purge_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by list (id)`));
      await execute(test.db, sql.raw(`create table ${name}_1 partition of ${name} for values in (1)`));
      await installFenceTrigger(test.db, gadgets(name));
      await execute(test.db, sql.raw(`create table ${name}_2 partition of ${name} for values in (2)`));
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at) values (2, 1, 20, now())`),
      );
      const later = new Date(Date.now() + 3_600_000);
      expect(await fencedRepository(test.db, gadgets(`${name}_2`)).purgeTombstones(later)).toBe(1);
      expect(await fencedRepository(test.db, gadgets(name)).upsert({ id: 2, stock: 2 }, f(19))).toEqual({
        status: 'stale',
        currentFence: 20n,
      });
      const parent = `purge_parent_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${parent} (${COLUMNS})`));
      await execute(test.db, sql.raw(`create table ${parent}_kid (primary key (id)) inherits (${parent})`));
      await installFenceTrigger(test.db, gadgets(`${parent}_kid`));
      await execute(
        test.db,
        sql.raw(`insert into ${parent}_kid (id, stock, last_fence, deleted_at) values (1, 1, 30, now())`),
      );
      expect(await fencedRepository(test.db, gadgets(parent)).purgeTombstones(later)).toBe(1);
      expect(await fencedRepository(test.db, gadgets(`${parent}_kid`)).upsert({ id: 1, stock: 2 }, f(29))).toEqual({
        status: 'stale',
        currentFence: 30n,
      });
      // The purge's mark holds for its own statement only: a plain DELETE after it in one transaction raises.
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at) values (2, 1, 40, now())`),
      );
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at) values (1, 1, 1, now())`),
      );
      await test.db.transaction(async (tx) => {
        const t = tx as unknown as Database;
        expect(await fencedRepository(t, gadgets(`${name}_1`)).purgeTombstones(later)).toBe(1);
        await execute(t, sql.raw(`delete from ${name}_2 where id = 2`));
      });
      expect(await fencedRepository(test.db, gadgets(name)).upsert({ id: 2, stock: 2 }, f(39))).toEqual({
        status: 'stale',
        currentFence: 40n,
      });
    });

    it.each([
      ['a DELETE whose partition moves to another tree while it runs', false],
      ['a DELETE nested in another of the same partition, after the tree changed,', true],
    ])('%s still closes what it opened', async (_what, nested) => {
      // Its statement triggers once worked out the floor each on their own: the DELETE opened the old tree's
      // floor and closed the new one's, and a later tombstone of the old tree, through a partition made after
      // the install, left its fence to a close that never came (an attack; there with DETACH … CONCURRENTLY
      // from another session, here in one transaction). Then the floor a DELETE opened was kept in one setting
      // per table: a nested DELETE (run by the function the outer one's WHERE calls, once that attached the
      // tree to another) overwrote the outer's, which closed the other tree's floor (a second attack).
      const name = `moved_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by range (id)`));
      await execute(test.db, sql.raw(`create table ${name}_1 partition of ${name} for values from (0) to (100)`));
      await installFenceTrigger(test.db, gadgets(name));
      await execute(test.db, sql.raw(`create table ${name}_late partition of ${name} for values from (100) to (200)`));
      await execute(test.db, sql.raw(`create table ${name}_outer (${COLUMNS}) partition by range (id)`));
      await execute(
        test.db,
        sql.raw(`create function ${name}_move() returns boolean language plpgsql as $$ begin
          if not exists (select 1 from pg_inherits where inhrelid = '${name}'::regclass) then
            alter table ${name}_outer attach partition ${name} for values from (0) to (1000);
            ${nested ? `delete from ${name}_1 where id = 2;` : ''}
          end if;
          return true; end $$`),
      );
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at)
          values (1, 1, 11, now()), (2, 1, 12, now()), (150, 1, 60, now())`),
      );
      await test.db.transaction(async (tx) => {
        const t = tx as unknown as Database;
        await execute(t, sql.raw(`delete from ${name}_1 where id = 1 and ${name}_move()`));
        await execute(t, sql.raw(`alter table ${name}_outer detach partition ${name}`));
        await execute(t, sql.raw(`delete from ${name}_late where id = 150`));
      });
      const repo = fencedRepository(test.db, gadgets(name));
      expect(await repo.upsert({ id: 150, stock: 2 }, f(55))).toEqual({ status: 'stale', currentFence: 60n });
    });

    it('a purge leaves no mark behind: a plain DELETE right after it in one transaction raises the floor', async () => {
      // The purge once marked its statement by statement_timestamp(), and the trigger left the rows of the
      // marked statement to it; on PGlite that clock moves in whole milliseconds, and a DELETE through a
      // partition made after the install, in the same millisecond, passed for the purge (an attack: one to
      // ten tries in a hundred). Whatever the clock: nothing of the purge's is left set once it returned.
      const name = `marked_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by list (id)`));
      await execute(test.db, sql.raw(`create table ${name}_1 partition of ${name} for values in (1)`));
      await installFenceTrigger(test.db, gadgets(name));
      await execute(test.db, sql.raw(`create table ${name}_2 partition of ${name} for values in (2)`));
      const later = new Date(Date.now() + 3_600_000);
      const repo = fencedRepository(test.db, gadgets(name));
      for (let i = 1; i <= 40; i++) {
        await execute(
          test.db,
          sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at)
            values (1, 1, ${100 * i - 1}, now()), (2, 1, ${100 * i}, now())`),
        );
        await test.db.transaction(async (tx) => {
          const t = tx as unknown as Database;
          expect(await fencedRepository(t, gadgets(`${name}_1`)).purgeTombstones(later)).toBe(1);
          const [left] = await execute(t, sql.raw(`select current_setting('palisade.purging', true) as mark`));
          expect(left?.mark ?? '').toBe('');
          await execute(t, sql.raw(`delete from ${name}_2 where id = 2`));
        });
        expect(await repo.upsert({ id: 2, stock: 2 }, f(100 * i - 1)), `try ${i}`).toEqual({
          status: 'stale',
          currentFence: BigInt(100 * i),
        });
        await execute(test.db, sql.raw(`delete from ${name}`));
      }
    });

    it("a tombstone that a row security policy's function removes during a purge raises the floor too", async () => {
      // The row trigger took every row removed at the first trigger depth during a purge's statement for one of
      // the purge's own, and left its floor to the purge — which raises only what its own DELETE returned. The
      // policy's function runs in the purge's statement, outside any trigger (an attack).
      const name = `policed_${++tableCount}`;
      const role = `palisade_policed_${process.pid}_${tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by range (id)`));
      await execute(test.db, sql.raw(`create table ${name}_0 partition of ${name} for values from (0) to (100)`));
      await installFenceTrigger(test.db, gadgets(name));
      await execute(test.db, sql.raw(`create table ${name}_late partition of ${name} for values from (100) to (200)`));
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at)
          values (101, 0, 50, now() - interval '1 hour'), (102, 0, 60, now())`),
      );
      // Removing 101 removes its companion 102 too (a hook in the DELETE policy).
      for (const statement of [
        `create function ${name}_cleanup(i int) returns boolean language plpgsql volatile as $$
           begin if i = 101 then delete from ${name}_late where id = 102; end if; return true; end $$`,
        `alter table ${name}_late enable row level security`,
        `create policy see on ${name}_late for select using (true)`,
        `create policy go on ${name}_late for delete using (${name}_cleanup(id))`,
        `create role ${role}`,
        `grant usage on schema palisade to ${role}`,
        `grant select, insert, update on palisade.tombstone_floors to ${role}`,
        `grant select, delete on ${name}, ${name}_late to ${role}`,
      ])
        await execute(test.db, sql.raw(statement));
      try {
        // Row security binds a role that is not the table's owner, nor a superuser.
        await test.db.transaction(async (tx) => {
          const t = tx as unknown as Database;
          await execute(t, sql.raw(`set local role ${role}`));
          const purged = await fencedRepository(t, gadgets(`${name}_late`)).purgeTombstones(
            new Date(Date.now() - 60_000),
          );
          expect(purged).toBe(1);
        });
        expect(await row(test.db, name, 102)).toBeUndefined();
        expect(await fencedRepository(test.db, gadgets(name)).upsert({ id: 102, stock: 9 }, f(55))).toEqual({
          status: 'stale',
          currentFence: 60n,
        });
      } finally {
        await execute(test.db, sql.raw(`drop owned by ${role}`));
        await execute(test.db, sql.raw(`drop role ${role}`));
      }
    });

    it('a tombstone removed while the purge raises the floors left to it raises its own floor', async () => {
      // The purge's mark held until its very end: a row removed while its last step raised the floors left to it
      // (here by a policy on palisade's floors table, which that raise runs) was left to a list already read —
      // and its fence, left behind, kept its floor off the list for the rest of the transaction (an attack).
      const a = `hooked_a_${++tableCount}`;
      const b = `hooked_b_${tableCount}`;
      const role = `palisade_hooked_${process.pid}_${tableCount}`;
      for (const name of [a, b]) {
        await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by range (id)`));
        await execute(test.db, sql.raw(`create table ${name}_0 partition of ${name} for values from (0) to (100)`));
        await installFenceTrigger(test.db, gadgets(name));
        await execute(
          test.db,
          sql.raw(`create table ${name}_late partition of ${name} for values from (100) to (200)`),
        );
      }
      await execute(
        test.db,
        sql.raw(`insert into ${a} (id, stock, last_fence, deleted_at) values (101, 0, 50, now() - interval '1 hour')`),
      );
      await execute(
        test.db,
        sql.raw(`insert into ${b} (id, stock, last_fence, deleted_at) values (102, 0, 70, now())`),
      );
      const policies = [
        `create function ${b}_hook() returns boolean language plpgsql volatile as $$
           begin delete from ${b}_late where id = 102; return true; end $$`,
        'alter table palisade.tombstone_floors enable row level security',
        `create policy ${role}_s on palisade.tombstone_floors for select using (true)`,
        `create policy ${role}_i on palisade.tombstone_floors for insert with check (true)`,
        `create policy ${role}_u on palisade.tombstone_floors for update using (${b}_hook())`,
        `create role ${role}`,
        `grant usage on schema palisade to ${role}`,
        `grant select, insert, update on palisade.tombstone_floors to ${role}`,
        `grant select, delete on ${a}, ${a}_late, ${b}, ${b}_late to ${role}`,
      ];
      for (const statement of policies) await execute(test.db, sql.raw(statement));
      try {
        await test.db.transaction(async (tx) => {
          const t = tx as unknown as Database;
          await execute(t, sql.raw(`set local role ${role}`));
          const later = new Date(Date.now() - 60_000);
          expect(await fencedRepository(t, gadgets(`${a}_late`)).purgeTombstones(later)).toBe(1);
        });
      } finally {
        await execute(test.db, sql.raw('alter table palisade.tombstone_floors disable row level security'));
        for (const policy of ['s', 'i', 'u'])
          await execute(test.db, sql.raw(`drop policy ${role}_${policy} on palisade.tombstone_floors`));
        await execute(test.db, sql.raw(`drop owned by ${role}`));
        await execute(test.db, sql.raw(`drop role ${role}`));
      }
      expect(await row(test.db, b, 102)).toBeUndefined();
      expect(await fencedRepository(test.db, gadgets(b)).upsert({ id: 102, stock: 9 }, f(60))).toEqual({
        status: 'stale',
        currentFence: 70n,
      });
    });

    it("purgeTombstones works beside the table's own trigger that removes more tombstones of it", async () => {
      // The nested DELETE's floor row came first, in a later command than the purge's own, whose
      // INSERT … ON CONFLICT could not see it: Postgres refused the purge (21000), which removed nothing.
      const name = `nodes_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}, parent integer)`));
      const table = pgTable(name, {
        id: integer('id').primaryKey(),
        stock: integer('stock').notNull(),
        parent: integer('parent'),
        ...fenceColumns(),
      });
      await installFenceTrigger(test.db, table);
      await execute(
        test.db,
        sql.raw(`create function ${name}_children() returns trigger language plpgsql as $$ begin
          delete from ${name} where parent = OLD.id and deleted_at is not null; return OLD; end $$`),
      );
      await execute(
        test.db,
        sql.raw(`create trigger a_children before delete on ${name} for each row execute function ${name}_children()`),
      );
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, parent, last_fence, deleted_at)
          values (1, 1, null, 10, now() - interval '2 hours'), (2, 1, 1, 20, now())`),
      );
      const repo = fencedRepository(test.db, table);
      expect(await repo.purgeTombstones(new Date(Date.now() - 3_600_000))).toBe(1);
      expect(await row(test.db, name, 2)).toBeUndefined();
      expect(await repo.upsert({ id: 2, stock: 2 }, f(19))).toEqual({ status: 'stale', currentFence: 20n });
    });

    it.each([
      ['changes the key, running before the guard', 'archive', 'NEW.id := OLD.id + 1000000'],
      ['changes the key, running after the guard', 'zz_archive', 'NEW.id := OLD.id + 1000000'],
      ['keeps last_fence, running after the guard', 'zz_keep_fence', 'NEW.last_fence := OLD.last_fence'],
      ['lowers last_fence, running after the guard', 'zz_keep_fence', 'NEW.last_fence := 0'],
    ])("refuses an UPDATE whose row the table's own trigger %s", async (_what, trigger, change) => {
      // The guards checked the row where they ran, in name order, and the key only when the statement named it: a
      // key moved by another BEFORE trigger left the old key without its fence, and one that runs after them put
      // the old fence back, or a lower one — either way a stale upsert or update then applied (two attacks).
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      await execute(
        test.db,
        sql.raw(`create function ${name}_own() returns trigger language plpgsql as $$ begin
          if NEW.stock < 0 then ${change}; end if; return NEW; end $$`),
      );
      await execute(
        test.db,
        sql.raw(`create trigger ${trigger} before update on ${name} for each row execute function ${name}_own()`),
      );
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(100));
      await refusal(test.db, `update ${name} set stock = -77, last_fence = last_fence + 1 where id = 1`);
      await expect(repo.update({ id: 1 }, f(200), { stock: -1 })).rejects.toMatchObject({
        sqlState: FENCE_TRIGGER_SQLSTATE,
      });
      expect(await row(test.db, name, 1)).toEqual({ stock: 5, fence: 100n, deleted: false });
      expect(await repo.update({ id: 1 }, f(3), { stock: 3 })).toMatchObject({ status: 'stale', currentFence: 100n });
      expect(await repo.update({ id: 1 }, f(200), { stock: 4 })).toMatchObject({ status: 'applied' });
    });

    it('guards a primary key that is a generated column', async () => {
      // A BEFORE trigger's WHEN may not read a generated column: the install failed outright.
      const name = `generated_${++tableCount}`;
      await execute(
        test.db,
        sql.raw(`create table ${name} (raw text not null, id text generated always as (lower(raw)) stored primary key,
          last_fence bigint not null default 0, deleted_at timestamptz)`),
      );
      await installFenceTrigger(test.db, { name });
      await execute(test.db, sql.raw(`insert into ${name} (raw, last_fence) values ('ABC', 10)`));
      await execute(test.db, sql.raw(`update ${name} set raw = 'abc', last_fence = 11 where id = 'abc'`));
      await refusal(test.db, `update ${name} set raw = 'XYZ', last_fence = 12 where id = 'abc'`);
      const [kept] = await execute(test.db, sql.raw(`select id, last_fence from ${name}`));
      expect({ id: kept?.id, fence: int8(kept?.last_fence) }).toEqual({ id: 'abc', fence: 11n });
    });

    it('takes a table whose name holds the dollar quote its SQL uses', async () => {
      const name = 'odd$palisade$name';
      await execute(test.db, sql.raw(`create table "${name}" (${COLUMNS})`));
      await installFenceTrigger(test.db, { name });
      await execute(test.db, sql.raw(`insert into "${name}" (id, stock, deleted_at) values (1, 5, now())`));
      await refusal(test.db, `update "${name}" set stock = 1`);
      await execute(test.db, sql.raw(`delete from "${name}" where id = 1`));
      for (const s of dropFenceTriggerStatements({ name })) await execute(test.db, sql.raw(s));
    });

    it("sameFence 'allow' accepts an equal fence; guardDeletes false leaves DELETE alone", async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table, { sameFence: 'allow', guardDeletes: false });
      const repo = fencedRepository(test.db, table, { sameFence: 'allow' });
      await repo.upsert({ id: 1, stock: 5 }, f(4));
      expect((await repo.update({ id: 1 }, f(4), { stock: 6 })).status).toBe('applied');
      expect((await repo.update({ id: 1 }, f(4), { stock: 7 })).status).toBe('applied');
      await refusal(test.db, `update ${name} set stock = 1, last_fence = 3`);
      await execute(test.db, sql.raw(`update ${name} set stock = 8`)); // equal fence: allowed by this option
      expect(await row(test.db, name)).toEqual({ stock: 8, fence: 4n, deleted: false });
      await execute(test.db, sql.raw(`delete from ${name} where id = 1`));
      expect(await row(test.db, name)).toBeUndefined();
    });

    it('dropFenceTriggerStatements removes the guard', async () => {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      await execute(test.db, sql.raw(`insert into ${name} (id, stock) values (1, 5)`));
      await refusal(test.db, `update ${name} set stock = 1`);
      for (const s of dropFenceTriggerStatements(table)) await execute(test.db, sql.raw(s));
      await execute(test.db, sql.raw(`update ${name} set stock = 1`));
      expect((await row(test.db, name))?.stock).toBe(1);
    });

    it('works for a table in another schema, named by string', async () => {
      await execute(test.db, sql`create schema if not exists "Inventory ""Q"""`);
      await execute(test.db, sql.raw(`create table "Inventory ""Q"""."Stock Items" (${COLUMNS})`));
      await installFenceTrigger(test.db, { schema: 'Inventory "Q"', name: 'Stock Items' });
      await execute(test.db, sql.raw(`insert into "Inventory ""Q"""."Stock Items" (id, stock) values (1, 5)`));
      await refusal(test.db, `update "Inventory ""Q"""."Stock Items" set stock = 1`);
    });
  });
}

describe.runIf(needs('DATABASE_URL'))('fence trigger: a role that may not raise the tombstone floor', () => {
  it('cannot delete tombstones either: its DELETE fails and removes nothing', async () => {
    const test = await postgresDatabase({ migrated: true });
    const role = `palisade_cleaner_${process.pid}_${Date.now()}`;
    try {
      const { name, table } = await freshTable(test.db);
      await installFenceTrigger(test.db, table);
      const repo = fencedRepository(test.db, table);
      await repo.upsert({ id: 1, stock: 5 }, f(10));
      expect((await repo.delete({ id: 1 }, f(20))).status).toBe('applied');
      // A cleanup job's role: it may delete from the table, not write palisade's floors.
      await execute(test.db, sql.raw(`create role ${role}; grant select, delete on ${name} to ${role}`));
      const refused = await execute(
        test.db,
        sql.raw(`do $$ begin set local role ${role}; delete from ${name} where deleted_at is not null; end $$`),
      ).then(
        () => undefined,
        (e: unknown) => e,
      );
      expect((refused as DatabaseError).sqlState).toBe('42501');
      expect(await row(test.db, name)).toEqual({ stock: 5, fence: 20n, deleted: true });
      expect(await repo.upsert({ id: 1, stock: 1 }, f(15))).toEqual({ status: 'stale', currentFence: 20n });
    } finally {
      await execute(test.db, sql.raw(`drop owned by ${role}; drop role if exists ${role}`)).catch(() => {});
      await test.close();
    }
  });
});

describe.runIf(needs('DATABASE_URL'))('fence trigger: purges beside one another', () => {
  it('two purges of overlapping batches through a partition made after the install both finish', async () => {
    // Without the purge's mark, each purge's first row raised the floor from its row trigger and held the
    // floor's row lock while the purge went on: A waited for a row B held, B for the floor A held (40P01, an
    // attack). The purge raises the floor at its end, which the mark keeps for it.
    const test = await postgresDatabase({ migrated: true });
    const sessions = Array.from({ length: 3 }, () => postgres(test.url as string, { max: 1, onnotice: () => {} }));
    try {
      const name = `overlap_${++tableCount}`;
      await execute(test.db, sql.raw(`create table ${name} (${COLUMNS}) partition by range (id)`));
      await execute(test.db, sql.raw(`create table ${name}_0 partition of ${name} for values from (0) to (100)`));
      await installFenceTrigger(test.db, gadgets(name));
      await execute(test.db, sql.raw(`create table ${name}_late partition of ${name} for values from (100) to (200)`));
      await execute(
        test.db,
        sql.raw(`insert into ${name} (id, stock, last_fence, deleted_at) values
          (101, 0, 10, now() - interval '1 hour'), (102, 0, 11, now() - interval '1 hour'),
          (103, 0, 12, now() - interval '3 hours'), (104, 0, 13, now() - interval '3 hours')`),
      );
      const [x, a, b] = sessions as [postgres.Sql, postgres.Sql, postgres.Sql];
      const pidOf = async (c: postgres.Sql) => Number((await c`select pg_backend_pid() as pid`)[0]?.pid);
      const [pidA, pidB] = [await pidOf(a), await pidOf(b)];
      const waiting = (pid: number) => waitingForLock(test.db, pid);
      const late = (c: postgres.Sql) => fencedRepository(drizzle(c) as unknown as Database, gadgets(`${name}_late`));
      // X, a writer, holds tombstone 102 until released.
      let release = () => {};
      const held = new Promise<void>((resolve) => {
        release = resolve;
      });
      let locked = () => {};
      const isLocked = new Promise<void>((resolve) => {
        locked = resolve;
      });
      const xDone = x.begin(async (tx) => {
        await tx`select 1 from ${x(`${name}_late`)} where id = 102 for update`;
        locked();
        await held;
      });
      await isLocked;
      // A purges all four (it removes 101, then waits at 102); B the two older ones, 103 and 104.
      const purgeA = late(a).purgeTombstones(new Date());
      await until(() => waiting(pidA));
      const purgeB = late(b).purgeTombstones(new Date(Date.now() - 2 * 3_600_000));
      await until(
        async () => (await waiting(pidB)) || (await outcomeOrStillWaiting(purgeB, 0)) !== 'still waiting after 0 s',
      );
      release();
      await xDone;
      expect(await Promise.all([purgeA, purgeB])).toEqual([2, 2]);
      expect(await execute(test.db, sql.raw(`select id from ${name}`))).toEqual([]);
      expect(await fencedRepository(test.db, gadgets(name)).upsert({ id: 104, stock: 1 }, f(13))).toEqual({
        status: 'stale',
        currentFence: 13n,
      });
    } finally {
      for (const c of sessions) await c.end();
      await test.close();
    }
  });
});

describe('fenceTriggerSql', () => {
  it('is a drizzle-kit migration: statements separated by breakpoints, function before triggers', () => {
    const table = pgTable('accounts', { id: integer('id').primaryKey(), ...fenceColumns() });
    const text = fenceTriggerSql(table);
    const parts = text.split('--> statement-breakpoint');
    expect(parts.map((p) => p.trim())).toEqual(fenceTriggerStatements(table));
    expect(parts).toHaveLength(13);
    // First, a check that no other role owns functions of those names.
    expect(parts[0]).toMatch(/^\s*DO \$palisade\$/);
    expect(parts[0]).toContain(`to_regprocedure('"palisade_fence_guard"()')`);
    expect(parts[1]).toMatch(/^\s*CREATE OR REPLACE FUNCTION "palisade_fence_guard"\(\)/);
    expect(parts[2]).toMatch(/^\s*CREATE OR REPLACE FUNCTION "palisade_fence_floor"\(\)/);
    expect(parts[1]).toContain('SET search_path = pg_catalog, pg_temp AS');
    expect(parts[2]).toContain('SET search_path = pg_catalog, pg_temp AS');
    // The key trigger of an earlier install, under its old name, goes too.
    expect(parts[6]).toMatch(/DROP TRIGGER IF EXISTS "palisade_fence_guard_key" ON "accounts"/);
    expect(parts[9]).toMatch(
      /BEFORE UPDATE ON "accounts" FOR EACH ROW EXECUTE FUNCTION "palisade_fence_guard"\('reject'\)/,
    );
    expect(parts[10]).toMatch(/BEFORE UPDATE ON %s FOR EACH ROW WHEN/);
    expect(parts[10]).toContain("'~palisade_fence_guard_key'");
    expect(parts[10]).toMatch(/AFTER UPDATE ON %s FOR EACH ROW WHEN/);
    expect(parts[10]).toContain('OPERATOR(%2$I.%3$s)');
    // Built and created with only pg_catalog on the search path, once the names are resolved by the installer's.
    expect(parts[10]).toContain(`tbl pg_catalog.regclass := '"accounts"'::pg_catalog.regclass;`);
    expect(parts[10]).toContain("pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true)");
    // On the table and every partition of its tree.
    expect(parts[12]).toMatch(/^\s*DO \$palisade\$/);
    expect(parts[12]).toContain('pg_partition_tree(tbl)');
    expect(parts[12]).toMatch(/AFTER DELETE ON %s REFERENCING OLD TABLE AS palisade_gone FOR EACH STATEMENT/);
    expect(fenceTriggerStatements(table, { guardDeletes: false })).toHaveLength(11);
  });

  it('refuses a table without fence columns, and bad options', () => {
    const plain = pgTable('plain', { id: integer('id').primaryKey() });
    expect(() => fenceTriggerSql(plain)).toThrow(/not fenced: spread fenceColumns\(\)/);
    expect(() => fenceTriggerSql({ name: '' })).toThrow(/drizzle table or/);
    const table = pgTable('t', { id: integer('id').primaryKey(), ...fenceColumns() });
    expect(() => fenceTriggerSql(table, { sameFence: 'maybe' as never })).toThrow(/sameFence/);
  });

  /**
   * The CLI prints the table name into a `--` comment line, and psql ends a
   * comment at a newline: a name with a line break would put the rest of it
   * on a line of its own, as SQL. Every control character (C0, DEL, C1) and
   * the Unicode line and paragraph separators are refused in any identifier,
   * before any SQL is produced.
   */
  const CONTROL: [string, string][] = [
    ['a newline', 'orders\nDROP TABLE victims; --'],
    ['a carriage return', 'orders\rDROP TABLE victims; --'],
    ['a tab', 'a\tb'],
    ['NUL', 'a\u0000b'],
    ['ESC', 'a\u001bb'],
    ['DEL', 'a\u007fb'],
    ['NEL (C1)', 'a\u0085b'],
    ['U+2028 line separator', 'a\u2028b'],
    ['U+2029 paragraph separator', 'a\u2029b'],
    ['a lone surrogate', 'a\ud800b'],
  ];

  it.each(CONTROL)('refuses %s in a table name, a schema name and a drizzle table', (_label, bad) => {
    const refused = (call: () => unknown) => {
      let err: unknown;
      try {
        call();
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(InvalidArgumentError);
      expect((err as InvalidArgumentError).code).toBe('invalid_argument');
      expect((err as Error).message).not.toContain(bad);
    };
    refused(() => fenceTriggerSql({ name: bad }));
    refused(() => fenceTriggerSql({ name: 'orders', schema: bad }));
    refused(() => fenceTriggerStatements({ name: bad }));
    refused(() => dropFenceTriggerStatements({ name: bad }));
    refused(() => fenceTriggerSql(pgTable(bad, { id: integer('id').primaryKey(), ...fenceColumns() })));
    refused(() => fenceTriggerSql(pgSchema(bad).table('t', { id: integer('id').primaryKey(), ...fenceColumns() })));
  });

  it('installFenceTrigger refuses a control character before sending anything', async () => {
    const sent: string[] = [];
    const db = { execute: async (q: string) => void sent.push(q) };
    await expect(installFenceTrigger(db, { name: 'orders\nDROP TABLE victims' })).rejects.toBeInstanceOf(
      InvalidArgumentError,
    );
    expect(sent).toEqual([]);
  });

  it('still accepts names that only need quoting: quotes, spaces, semicolons, Unicode', () => {
    for (const name of ['we"ird', 'two words', 'a;b', 'café', '注文', 'a--b']) {
      expect(fenceTriggerSql({ name })).toContain(`"${name.replaceAll('"', '""')}"`);
    }
  });
});
