/**
 * Tables whose rows or definitions are easy to confuse: a partitioned table
 * (a row's ctid repeats across partitions; Postgres refuses system columns
 * in its RETURNING), two definitions of one table whose primary keys list
 * the columns in different orders or whose columns (or array elements)
 * encode differently, and a table named `s.acc` beside the table `acc` of
 * schema `s`. Each write and purge must touch exactly the rows it names. On
 * every driver (PGlite always, the real Postgres when DATABASE_URL is set).
 * test/property/table-shapes.test.ts searches for more such definitions.
 */
import { sql } from 'drizzle-orm';
import { alias, customType, integer, pgSchema, pgTable, primaryKey, text } from 'drizzle-orm/pg-core';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Database } from '../../src/driver.js';
import { InvalidArgumentError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { drivers, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { newPglite } from '../support/pglite.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { uniqueName } from './fixtures.js';

const f = toFence;

async function rows(db: Database, query: ReturnType<typeof sql>): Promise<Record<string, unknown>[]> {
  const result = (await db.execute(query)) as unknown as { rows?: Record<string, unknown>[] };
  return (result.rows ?? result) as Record<string, unknown>[];
}

/** The `acc` tables of the tests below: their DDL after `create table <name>`, and their drizzle columns. */
const ACC_DDL = '(id text primary key, v int not null, last_fence bigint not null default 0, deleted_at timestamptz)';
const accColumns = () => ({ id: text('id').primaryKey(), v: integer('v').notNull(), ...fenceColumns() });
const accTable = (name: string) => pgTable(name, accColumns());

/** What {@link purged} calls: a repository of any `acc` table, with or without a schema. */
interface AccWrites {
  upsert(row: { id: string; v: number }, fence: Fence): Promise<{ status: string }>;
  delete(key: { id: string }, fence: Fence): Promise<{ status: string }>;
  purgeTombstones(olderThan: Date): Promise<number>;
}

/** Row `id` written at `written`, deleted at `deleted` and purged through `repo`: the floor is now `deleted`. */
async function purged(repo: AccWrites, id: string, written: number, deleted: number): Promise<void> {
  expect((await repo.upsert({ id, v: 1 }, f(written))).status).toBe('applied');
  expect((await repo.delete({ id }, f(deleted))).status).toBe('applied');
  expect(await repo.purgeTombstones(new Date(Date.now() + 60_000))).toBe(1);
}

describe.each(drivers)('which rows a write touches, on $name', ({ open }) => {
  let test: TestDatabase;
  let db: Database;

  beforeAll(async () => {
    test = await open();
    db = test.db;
    await migrate(db);
  });
  afterAll(() => test?.close());

  const regions = (name: string) =>
    pgTable(
      name,
      {
        region: text('region').notNull(),
        id: text('id').notNull(),
        balance: integer('balance').notNull(),
        ...fenceColumns(),
      },
      (t) => [primaryKey({ columns: [t.region, t.id] })],
    );

  async function createPartitioned(name: string) {
    await db.execute(
      sql.raw(`create table ${name} (region text not null, id text not null, balance int not null,
        last_fence bigint not null default 0, deleted_at timestamptz, primary key (region, id)) partition by list (region)`),
    );
    await db.execute(sql.raw(`create table ${name}_eu partition of ${name} for values in ('eu')`));
    await db.execute(sql.raw(`create table ${name}_us partition of ${name} for values in ('us')`));
  }

  it('upsert on a partitioned table creates, updates, refuses a stale fence and resurrects a tombstone', async () => {
    const name = uniqueName('parted');
    await createPartitioned(name);
    const repo = fencedRepository(db, regions(name));
    expect((await repo.upsert({ region: 'eu', id: 'alice', balance: 1 }, f(10))).status).toBe('applied');
    expect((await repo.upsert({ region: 'eu', id: 'alice', balance: 2 }, f(11))).status).toBe('applied');
    expect((await repo.upsert({ region: 'eu', id: 'alice', balance: 3 }, f(9))).status).toBe('stale');
    expect((await repo.delete({ region: 'eu', id: 'alice' }, f(12))).status).toBe('applied');
    expect((await repo.upsert({ region: 'eu', id: 'alice', balance: 4 }, f(12))).status).toBe('duplicate');
    const back = await repo.upsert({ region: 'eu', id: 'alice', balance: 5 }, f(13));
    expect(back).toMatchObject({ status: 'applied', row: { balance: 5, lastFence: 13n, deletedAt: null } });
  });

  it('a purge on a partitioned table removes the tombstones only, though live rows of another partition share their ctids', async () => {
    const name = uniqueName('parted');
    await createPartitioned(name);
    const repo = fencedRepository(db, regions(name));
    await db.execute(
      sql.raw(`insert into ${name} (region, id, balance, last_fence)
        select 'eu', 'a' || i, i, 10 from generate_series(1, 4) i
        union all select 'us', 'a' || i, i, 10 from generate_series(1, 12) i`),
    );
    expect((await repo.delete({ region: 'eu', id: 'a2' }, f(20))).status).toBe('applied');
    expect((await repo.delete({ region: 'eu', id: 'a3' }, f(21))).status).toBe('applied');
    // Each tombstone is a new row version in eu whose ctid a live row of us also has.
    const shared = await rows(
      db,
      sql.raw(`select count(*)::int as n from ${name}_eu e join ${name}_us u on e.ctid = u.ctid
        where e.deleted_at is not null and u.deleted_at is null`),
    );
    expect(shared[0]?.n).toBe(2);

    expect(await repo.purgeTombstones(new Date(Date.now() + 60_000))).toBe(2);
    const left = await rows(db, sql.raw(`select region, id from ${name} order by region, id`));
    expect(left.map((r) => `${r.region}/${r.id}`)).toEqual([
      'eu/a1',
      'eu/a4',
      ...Array.from({ length: 12 }, (_, i) => `us/a${i + 1}`).sort(),
    ]);
    // The floor is the highest fence purged: recreating a purged key needs a fence above it.
    expect((await repo.upsert({ region: 'eu', id: 'a3', balance: 0 }, f(21))).status).toBe('stale');
    expect((await repo.update({ region: 'us', id: 'a3' }, f(22), { balance: 30 })).status).toBe('applied');
  });

  it('two definitions of one table, primary key listed in different orders: each writes the key it names', async () => {
    const name = uniqueName('pk');
    await db.execute(
      sql.raw(`create table ${name} (tenant text not null, id text not null, v int not null,
        last_fence bigint not null default 0, deleted_at timestamptz, primary key (tenant, id))`),
    );
    await db.execute(sql.raw(`insert into ${name} (tenant, id, v) values ('acme', 'bob', 0), ('bob', 'acme', 0)`));
    const columns = () => ({
      tenant: text('tenant').notNull(),
      id: text('id').notNull(),
      v: integer('v').notNull(),
      ...fenceColumns(),
    });
    const byTenant = fencedRepository(
      db,
      pgTable(name, columns(), (t) => [primaryKey({ columns: [t.tenant, t.id] })]),
    );
    const byId = fencedRepository(
      db,
      pgTable(name, columns(), (t) => [primaryKey({ columns: [t.id, t.tenant] })]),
    );
    expect((await byTenant.update({ tenant: 'acme', id: 'bob' }, f(1), { v: 1 })).status).toBe('applied');
    const second = await byId.update({ tenant: 'acme', id: 'bob' }, f(2), { v: 2 });
    expect(second).toMatchObject({ status: 'applied', row: { tenant: 'acme', id: 'bob', v: 2 } });
    expect((await byId.delete({ tenant: 'acme', id: 'bob' }, f(3))).status).toBe('applied');
    const all = await rows(db, sql.raw(`select tenant, id, v, last_fence::text as fence from ${name} order by tenant`));
    expect(all).toEqual([
      { tenant: 'acme', id: 'bob', v: 2, fence: '3' },
      { tenant: 'bob', id: 'acme', v: 0, fence: '0' },
    ]);
  });

  it('two definitions of one table whose key columns encode differently: each write sends its own encoding', async () => {
    const name = uniqueName('enc');
    await db.execute(
      sql.raw(`create table ${name} (id text primary key, balance int not null,
        last_fence bigint not null default 0, deleted_at timestamptz)`),
    );
    await db.execute(sql.raw(`insert into ${name} (id, balance) values ('alice', 0), ('Alice', 0)`));
    const lowercased = customType<{ data: string }>({
      dataType: () => 'text',
      toDriver: (value) => value.toLowerCase(),
    });
    const columns = { balance: integer('balance').notNull(), ...fenceColumns() };
    const folding = fencedRepository(db, pgTable(name, { id: lowercased('id').primaryKey(), ...columns }));
    const plain = fencedRepository(db, pgTable(name, { id: text('id').primaryKey(), ...columns }));
    expect((await folding.update({ id: 'ALICE' }, f(5), { balance: 100 })).status).toBe('applied');
    expect(await plain.update({ id: 'Alice' }, f(6), { balance: 200 })).toMatchObject({
      status: 'applied',
      row: { id: 'Alice', balance: 200 },
    });
    expect((await plain.upsert({ id: 'Carol', balance: 1 }, f(7))).status).toBe('applied');
    expect((await folding.upsert({ id: 'DAVE', balance: 2 }, f(8))).status).toBe('applied');
    const all = await rows(
      db,
      sql.raw(`select id, balance, last_fence::text as fence from ${name} order by id collate "C"`),
    );
    expect(all).toEqual([
      { id: 'Alice', balance: 200, fence: '6' },
      { id: 'Carol', balance: 1, fence: '7' },
      { id: 'alice', balance: 100, fence: '5' },
      { id: 'dave', balance: 2, fence: '8' },
    ]);
  });

  it('two definitions of one table whose array elements encode differently: each write sends its own encoding', async () => {
    const name = uniqueName('arr');
    await db.execute(
      sql.raw(`create table ${name} (id text primary key, tags text[],
        last_fence bigint not null default 0, deleted_at timestamptz)`),
    );
    await db.execute(sql.raw(`insert into ${name} (id) values ('k')`));
    // Every array column is one class with the SQL type `text[]`: only the elements' encoder differs.
    const lowercased = customType<{ data: string }>({
      dataType: () => 'text',
      toDriver: (value) => value.toLowerCase(),
    });
    const folding = fencedRepository(
      db,
      pgTable(name, { id: text('id').primaryKey(), tags: lowercased('tags').array(), ...fenceColumns() }),
    );
    const plain = fencedRepository(
      db,
      pgTable(name, { id: text('id').primaryKey(), tags: text('tags').array(), ...fenceColumns() }),
    );
    expect((await plain.update({ id: 'k' }, f(1), { tags: ['Red'] })).status).toBe('applied');
    expect((await folding.update({ id: 'k' }, f(2), { tags: ['Red', 'BLUE'] })).status).toBe('applied');
    expect((await folding.upsert({ id: 'folded', tags: ['Green'] }, f(3))).status).toBe('applied');
    expect((await plain.upsert({ id: 'kept', tags: ['Green'] }, f(4))).status).toBe('applied');
    const all = await rows(db, sql.raw(`select id, to_json(tags)::text as tags from ${name} order by id collate "C"`));
    expect(all).toEqual([
      { id: 'folded', tags: '["green"]' },
      { id: 'k', tags: '["red","blue"]' },
      { id: 'kept', tags: '["Green"]' },
    ]);
  });

  it('a column key holding a comma beside the keys it spells: the patches {x, y} and {"x,y"} write their own columns', async () => {
    const name = uniqueName('comma');
    await db.execute(
      sql.raw(`create table ${name} (id text primary key, x int, y int, xy int,
        last_fence bigint not null default 0, deleted_at timestamptz)`),
    );
    await db.execute(sql.raw(`insert into ${name} (id, x, y, xy) values ('a', 0, 0, 0)`));
    const table = pgTable(name, {
      id: text('id').primaryKey(),
      x: integer('x'),
      y: integer('y'),
      'x,y': integer('xy'),
      ...fenceColumns(),
    });
    const repo = fencedRepository(db, table);
    expect((await repo.update({ id: 'a' }, f(1), { 'x,y': 7 })).status).toBe('applied');
    expect((await repo.update({ id: 'a' }, f(2), { x: 10, y: 20 })).status).toBe('applied');
    expect((await repo.upsert({ id: 'b', 'x,y': 7 }, f(3))).status).toBe('applied');
    expect((await repo.upsert({ id: 'b', x: 10, y: 20 }, f(4))).status).toBe('applied');
    expect(await rows(db, sql.raw(`select id, x, y, xy from ${name} order by id`))).toEqual([
      { id: 'a', x: 10, y: 20, xy: 7 },
      { id: 'b', x: 10, y: 20, xy: 7 },
    ]);
  });

  it('an alias() of a table is refused: it compiles to the alias name but describes the table', async () => {
    const table = pgTable(uniqueName('aliased'), { id: text('id').primaryKey(), ...fenceColumns() });
    expect(() => fencedRepository(db, alias(table, 'other'))).toThrow(InvalidArgumentError);
    expect(() => fencedRepository(db, alias(table, 'other'))).toThrow(/alias/);
  });

  it('a table named "s.acc" and the table acc of schema s: each write lands in the table it names', async () => {
    const schema = uniqueName('s');
    const dotted = `${schema}.acc`;
    await db.execute(sql.raw(`create schema ${schema}`));
    await db.execute(sql.raw(`create table "${dotted}" ${ACC_DDL}`));
    await db.execute(sql.raw(`create table ${schema}.acc ${ACC_DDL}`));
    await db.execute(sql.raw(`insert into "${dotted}" (id, v) values ('k', 0)`));
    await db.execute(sql.raw(`insert into ${schema}.acc (id, v) values ('k', 0)`));
    const inPublic = fencedRepository(db, accTable(dotted));
    const inSchema = fencedRepository(db, pgSchema(schema).table('acc', accColumns()));
    expect((await inPublic.update({ id: 'k' }, f(5), { v: 1 })).status).toBe('applied');
    expect((await inSchema.update({ id: 'k' }, f(6), { v: 2 })).status).toBe('applied');
    const read = async (table: string) =>
      (await rows(db, sql.raw(`select v, last_fence::text as fence from ${table}`)))[0];
    expect(await read(`"${dotted}"`)).toEqual({ v: 1, fence: '5' });
    expect(await read(`${schema}.acc`)).toEqual({ v: 2, fence: '6' });
  });

  it('a partitioned table and a definition of one of its partitions: a purge through either raises the floor the other checks', async () => {
    const name = uniqueName('ptree');
    await db.execute(sql.raw(`create table ${name} ${ACC_DDL} partition by list (id)`));
    await db.execute(sql.raw(`create table ${name}_k partition of ${name} for values in ('k', 'j')`));
    const parent = fencedRepository(db, accTable(name));
    const partition = fencedRepository(db, accTable(`${name}_k`));
    await purged(parent, 'k', 5, 6);
    expect(await partition.upsert({ id: 'k', v: 2 }, f(4))).toEqual({ status: 'stale', currentFence: f(6) });
    await purged(partition, 'j', 7, 8);
    expect(await parent.upsert({ id: 'j', v: 2 }, f(7))).toEqual({ status: 'stale', currentFence: f(8) });
    expect(await rows(db, sql.raw(`select id from ${name}`))).toEqual([]);
  });

  it("an inheritance child's tombstone purged through its parent: an upsert through the child sees the floor", async () => {
    const name = uniqueName('inh');
    await db.execute(sql.raw(`create table ${name} ${ACC_DDL}`));
    await db.execute(sql.raw(`create table ${name}_c (primary key (id)) inherits (${name})`));
    const child = fencedRepository(db, accTable(`${name}_c`));
    const parent = fencedRepository(db, accTable(name));
    expect((await child.upsert({ id: 'k', v: 1 }, f(5))).status).toBe('applied');
    expect((await child.delete({ id: 'k' }, f(6))).status).toBe('applied');
    expect(await parent.purgeTombstones(new Date(Date.now() + 60_000))).toBe(1);
    expect(await child.upsert({ id: 'k', v: 2 }, f(4))).toEqual({ status: 'stale', currentFence: f(6) });
    expect(await rows(db, sql.raw(`select id from ${name}_c`))).toEqual([]);
  });

  it("a table of the same name appears earlier on the search path after the upsert was prepared: the floor is still the written table's", async () => {
    const name = uniqueName('shadow');
    const tenant = uniqueName('tenant');
    await db.execute(sql.raw(`create schema ${tenant}`));
    await db.execute(sql.raw(`create table public.${name} ${ACC_DDL}`));
    // One transaction: one connection, whose prepared statements outlive the new table (Postgres does
    // not re-plan a statement when a table of the same name appears earlier on the search path).
    await db.transaction(async (tx) => {
      await tx.execute(sql.raw(`set local search_path to ${tenant}, public`));
      const repo = fencedRepository(tx, accTable(name));
      for (let i = 0; i < 6; i++) expect((await repo.upsert({ id: `warm${i}`, v: 1 }, f(1))).status).toBe('applied');
      await purged(repo, 'k', 5, 6);
      await tx.execute(sql.raw(`create table ${tenant}.${name} ${ACC_DDL}`));
      const late = await repo.upsert({ id: 'k', v: 2 }, f(4));
      expect(await rows(tx, sql.raw(`select id from public.${name} where id = 'k'`))).toEqual([]);
      // Wherever the statement now writes, a row written there at fence 4 must not be public's purged k.
      if (late.status === 'applied') {
        expect(await rows(tx, sql.raw(`select id from ${tenant}.${name} where id = 'k'`))).toEqual([{ id: 'k' }]);
      } else {
        expect(late).toEqual({ status: 'stale', currentFence: f(6) });
      }
    });
  });

  it("ALTER TABLE … RENAME and SET SCHEMA keep the floor; a dropped table's floor row reads as a bare oid the README's query removes", async () => {
    const name = uniqueName('moved');
    const schema = uniqueName('dest');
    await db.execute(sql.raw(`create schema ${schema}`));
    await db.execute(sql.raw(`create table ${name} ${ACC_DDL}`));
    const before = fencedRepository(db, accTable(name));
    await purged(before, 'k', 5, 6);
    await db.execute(sql.raw(`alter table ${name} rename to ${name}_r`));
    await db.execute(sql.raw(`alter table ${name}_r set schema ${schema}`));
    const after = fencedRepository(db, pgSchema(schema).table(`${name}_r`, accColumns()));
    expect(await after.upsert({ id: 'k', v: 2 }, f(4))).toEqual({ status: 'stale', currentFence: f(6) });
    expect(await rows(db, sql.raw(`select id from ${schema}.${name}_r`))).toEqual([]);
    // Dropped: its row stays, named by a number; the README's cleanup removes that row and no other.
    const count = async (where: string) =>
      rows(db, sql.raw(`select count(*)::int as n from palisade.tombstone_floors where ${where}`));
    await db.execute(sql.raw(`drop table ${schema}.${name}_r`));
    expect(await count(`fenced_table::text ~ '^[0-9]+$'`)).toEqual([{ n: 1 }]);
    const named = await count(`fenced_table::text !~ '^[0-9]+$'`);
    await db.execute(sql.raw(`delete from palisade.tombstone_floors where fenced_table::text ~ '^[0-9]+$'`));
    expect(await count('true')).toEqual(named);
  });

  it('one table named with its schema and, on a connection whose search_path holds that schema, without: one floor', async () => {
    const schema = uniqueName('sp');
    await db.execute(sql.raw(`create schema ${schema}`));
    await db.execute(sql.raw(`create table ${schema}.acc ${ACC_DDL}`));
    const qualified = pgSchema(schema).table('acc', accColumns());
    const bare = accTable('acc');
    const left = async (tx: Database) => rows(tx, sql.raw(`select id from ${schema}.acc`));
    // A transaction keeps one connection, so `set local search_path` holds for every statement in it.
    await db.transaction(async (tx) => {
      await tx.execute(sql.raw(`set local search_path to ${schema}`));
      const viaSchema = fencedRepository(tx, qualified);
      const viaPath = fencedRepository(tx, bare);
      await purged(viaPath, 'k', 5, 6);
      // The holder of fence 4 never saw the delete at 6: bringing the row back is a stale write.
      expect(await viaSchema.upsert({ id: 'k', v: 2 }, f(4))).toEqual({ status: 'stale', currentFence: f(6) });
      expect(await left(tx)).toEqual([]);
      // And the other way round.
      await purged(viaSchema, 'j', 7, 8);
      expect(await viaPath.upsert({ id: 'j', v: 2 }, f(7))).toEqual({ status: 'stale', currentFence: f(8) });
      expect(await left(tx)).toEqual([]);
    });
  });
});

describe("drizzle's casing option (not supported, README 'The write path')", () => {
  it('a column named by casing alone: the write fails with 42703 and writes nothing, nowhere else', async () => {
    const client = newPglite();
    try {
      const db = drizzlePglite(client, { casing: 'snake_case' }) as unknown as Database;
      await migrate(db);
      await db.execute(
        sql.raw(`create table cased (id text primary key, foo_bar int not null default 0,
          last_fence bigint not null default 0, deleted_at timestamptz)`),
      );
      await db.execute(sql.raw(`insert into cased (id) values ('k')`));
      // fooBar has no database name of its own: drizzle would derive foo_bar; palisade sends "fooBar".
      const repo = fencedRepository(
        db,
        pgTable('cased', { id: text('id').primaryKey(), fooBar: integer(), ...fenceColumns() }),
      );
      await expect(repo.update({ id: 'k' }, f(1), { fooBar: 7 })).rejects.toMatchObject({
        message: /42703|does not exist/,
      });
      expect(await rows(db, sql.raw(`select foo_bar, last_fence::int as fence from cased`))).toEqual([
        { foo_bar: 0, fence: 0 },
      ]);
    } finally {
      await client.close();
    }
  });
});

describe.runIf(needs('DATABASE_URL'))('concurrent purges of one table (real Postgres)', () => {
  let test: TestDatabase;
  beforeAll(async () => {
    test = await postgresDatabase();
    await migrate(test.db);
  });
  afterAll(() => test?.close());

  /** A purge started while `first` (run in a transaction held open until released) has purged. */
  async function behindAnOpenPurge(first: (tx: Database) => Promise<number>, second: () => Promise<number>) {
    let release: () => void = () => {};
    const held = new Promise<void>((resolve) => {
      release = resolve;
    });
    let firstPurged = -1;
    const firstDone = test.db.transaction(async (tx) => {
      firstPurged = await first(tx as unknown as Database);
      await held;
    });
    for (let i = 0; i < 200 && firstPurged < 0; i++) await sleep(10);
    const secondDone = second();
    // Bounded: the second purge is seen waiting for the first one's rows.
    let waiting = 0;
    for (let i = 0; i < 200 && waiting === 0; i++) {
      const [row] = await rows(
        test.db,
        sql`select count(*)::int as n from pg_stat_activity
            where datname = current_database() and wait_event_type = 'Lock' and query like '%palisade_row%'`,
      );
      waiting = Number(row?.n);
      if (waiting === 0) await sleep(20);
    }
    release();
    await firstDone;
    return { firstPurged, secondPurged: await secondDone, waiting };
  }

  it('a purge whose whole batch another purge removed while it waited picks again: 0 only when none is left', async () => {
    const name = uniqueName('again');
    await test.db.execute(sql.raw(`create table ${name} ${ACC_DDL}`));
    await test.db.execute(
      sql.raw(`insert into ${name} select 'k' || g, 0, g, now() - interval '1 hour' from generate_series(1, 10) g`),
    );
    const later = new Date(Date.now() + 60_000);
    const purge = (db: Database) => fencedRepository(db, accTable(name)).purgeTombstones(later, { batchSize: 5 });
    const { firstPurged, secondPurged, waiting } = await behindAnOpenPurge(purge, () => purge(test.db));
    expect(waiting).toBe(1);
    expect([firstPurged, secondPurged]).toEqual([5, 5]);
    expect(await rows(test.db, sql.raw(`select count(*)::int as n from ${name}`))).toEqual([{ n: 0 }]);
  });

  it('purge loops run at once, each calling until 0: a loop stops only when what is left is in the other loops’ batches', async () => {
    const name = uniqueName('loops');
    await test.db.execute(sql.raw(`create table ${name} ${ACC_DDL}`));
    await test.db.execute(
      sql.raw(`insert into ${name} select 'k' || g, 0, g, now() - interval '1 hour' from generate_series(1, 6000) g`),
    );
    const later = new Date(Date.now() + 60_000);
    const [loops, batchSize] = [3, 200];
    const leftAtZero: number[] = [];
    const purged = await Promise.all(
      Array.from({ length: loops }, async () => {
        const repo = fencedRepository(test.db, accTable(name));
        let total = 0;
        // Bounded: 6,000 rows in batches of 200 take 30 batches in all.
        for (let i = 0; i < 200; i++) {
          const n = await repo.purgeTombstones(later, { batchSize });
          if (n === 0) break;
          total += n;
        }
        const [row] = await rows(test.db, sql.raw(`select count(*)::int as n from ${name}`));
        leftAtZero.push(Number(row?.n));
        return total;
      }),
    );
    // When a loop saw 0, at most the other loops' batches in flight were left (they remove them).
    for (const left of leftAtZero) expect(left).toBeLessThanOrEqual((loops - 1) * batchSize);
    expect(purged.reduce((a, b) => a + b, 0)).toBe(6000);
    expect(await rows(test.db, sql.raw(`select count(*)::int as n from ${name}`))).toEqual([{ n: 0 }]);
  });

  it('purges through an inheritance parent and its child, the child’s held open: no deadlock, every tombstone gone once', async () => {
    const name = uniqueName('inhp');
    await test.db.execute(sql.raw(`create table ${name} ${ACC_DDL}`));
    await test.db.execute(sql.raw(`create table ${name}_c (primary key (id)) inherits (${name})`));
    await test.db.execute(
      sql.raw(`insert into ${name}_c select 'k' || g, 0, g, now() - interval '1 hour' from generate_series(1, 40) g`),
    );
    const later = new Date(Date.now() + 60_000);
    const { firstPurged, secondPurged, waiting } = await behindAnOpenPurge(
      (tx) => fencedRepository(tx, accTable(`${name}_c`)).purgeTombstones(later, { batchSize: 25 }),
      () => fencedRepository(test.db, accTable(name)).purgeTombstones(later),
    );
    expect(waiting).toBe(1);
    expect([firstPurged, secondPurged]).toEqual([25, 15]);
    expect(await rows(test.db, sql.raw(`select count(*)::int as n from ${name}`))).toEqual([{ n: 0 }]);
    const [floor] = await rows(
      test.db,
      sql.raw(`select floor::int as floor from palisade.tombstone_floors where fenced_table = '${name}_c'::regclass`),
    );
    expect(floor).toEqual({ floor: 40 });
  });

  it('a caller’s transaction that holds a tombstone and then purges with nothing to purge does not wait for other purges', async () => {
    const name = uniqueName('holds');
    await test.db.execute(sql.raw(`create table ${name} ${ACC_DDL}`));
    await test.db.execute(
      sql.raw(`insert into ${name} select 'k' || g, 0, g, now() - interval '1 hour' from generate_series(1, 4) g`),
    );
    const repo = (db: Database) => fencedRepository(db, accTable(name));
    let release: () => void = () => {};
    const held = new Promise<void>((resolve) => {
      release = resolve;
    });
    let holding = false;
    let inTx = -1;
    const caller = test.db.transaction(async (tx) => {
      // Brings k2 back: its row stays locked until this transaction ends.
      expect((await repo(tx as unknown as Database).upsert({ id: 'k2', v: 1 }, f(100))).status).toBe('applied');
      holding = true;
      await held;
      inTx = await repo(tx as unknown as Database).purgeTombstones(new Date(0));
    });
    for (let i = 0; i < 200 && !holding; i++) await sleep(10);
    // Another purge queues on k2.
    const other = repo(test.db).purgeTombstones(new Date(Date.now() + 60_000));
    let waiting = 0;
    for (let i = 0; i < 200 && waiting === 0; i++) {
      const [row] = await rows(
        test.db,
        sql`select count(*)::int as n from pg_stat_activity
            where datname = current_database() and wait_event_type = 'Lock' and query like '%palisade_row%'`,
      );
      waiting = Number(row?.n);
      if (waiting === 0) await sleep(20);
    }
    release();
    await caller;
    expect(waiting).toBe(1);
    expect(inTx).toBe(0);
    expect(await other).toBe(3);
    expect(await rows(test.db, sql.raw(`select id from ${name}`))).toEqual([{ id: 'k2' }]);
  });
});
