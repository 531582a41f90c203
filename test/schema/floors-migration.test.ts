/**
 * Migration 0008 moves tombstone floors from a key by name (`schema.name` or
 * `name`, unquoted, the latter resolved by each connection's search_path) to
 * a key by table (`regclass`; a partition tree's root for its partitions;
 * an inheritance parent's floor also goes to its children). An
 * old name may spell more than one table; every table it can spell, in any
 * schema, must keep the floor, so an upsert after the upgrade refuses at
 * least what it refused before.
 */
import { readFileSync } from 'node:fs';
import { sql } from 'drizzle-orm';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { pgliteDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';

const journal = JSON.parse(readFileSync('drizzle/meta/_journal.json', 'utf8')) as { entries: { tag: string }[] };
const statements = (tag: string) =>
  readFileSync(`drizzle/${tag}.sql`, 'utf8')
    .split('--> statement-breakpoint')
    .filter((s) => s.trim() !== '');

describe('migration 0008: tombstone floors keyed by table', () => {
  let test: TestDatabase;
  const run = async (text: string) =>
    ((await test.db.execute(sql.raw(text))) as unknown as { rows: Record<string, unknown>[] }).rows;

  beforeAll(async () => {
    test = await pgliteDatabase();
    const tags = journal.entries.map((e) => e.tag);
    const at = tags.indexOf('0008_floors_by_table');
    expect(at).toBeGreaterThan(0);
    for (const tag of tags.slice(0, at)) for (const s of statements(tag)) await run(s);
    const ddl = '(id text primary key, last_fence bigint not null default 0, deleted_at timestamptz)';
    await run('create schema s');
    await run(`create table acc ${ddl}`);
    await run(`create table s.acc ${ddl}`);
    await run(`create table "s.acc" ${ddl}`);
    await run(`create table "Mixed" ${ddl}`);
    // Tenant schemas: a bare `acc` reached each of these through its connection's search_path.
    await run('create schema t1');
    await run(`create table t1.acc ${ddl}`);
    // A partition's floor belongs to its tree.
    await run(
      'create table pt (id text primary key, last_fence bigint not null default 0, deleted_at timestamptz) partition by hash (id)',
    );
    await run('create table pt_p0 partition of pt for values with (modulus 2, remainder 0)');
    await run('create table pt_p1 partition of pt for values with (modulus 2, remainder 1)');
    // An inheritance parent's purge removed its children's rows too.
    await run(`create table par ${ddl}`);
    await run('create table kid (primary key (id)) inherits (par)');
    // Floors as earlier versions keyed them, by the repository's spelling of the name.
    await run(`insert into palisade.tombstone_floors (table_name, floor) values
      ('acc', 5), ('s.acc', 7), ('Mixed', 9), ('dropped_long_ago', 11), ('pt_p0', 12), ('pt', 3), ('par', 13)`);
    // As migrate() applies it: in one transaction (its LOCK TABLE needs one).
    await run('begin');
    for (const s of statements('0008_floors_by_table')) await run(s);
    await run('commit');
  });
  afterAll(() => test?.close());

  it('keeps every floor on each table its old name can spell, in any schema, and none for a table that is gone', async () => {
    const rows = await run(
      'select fenced_table::text as t, floor::text as floor from palisade.tombstone_floors order by 1',
    );
    expect(rows).toEqual([
      { t: '"Mixed"', floor: '9' },
      { t: '"s.acc"', floor: '7' },
      { t: 'acc', floor: '5' },
      { t: 'kid', floor: '13' },
      { t: 'par', floor: '13' },
      { t: 'pt', floor: '12' },
      { t: 's.acc', floor: '7' },
      { t: 't1.acc', floor: '5' },
    ]);
  });

  it('the floor check refuses a fence at the kept floor and lets one above it through', async () => {
    const sqlState = (text: string) =>
      run(text).then(
        () => null,
        (e: { cause?: { code?: string } }) => e.cause?.code ?? 'no SQLSTATE',
      );
    expect(await sqlState(`select palisade.check_tombstone_floor('s.acc'::regclass, 7, false)`)).toBe('40001');
    expect(await sqlState(`select palisade.check_tombstone_floor('"s.acc"'::regclass, 7, false)`)).toBe('40001');
    expect(await sqlState(`select palisade.check_tombstone_floor('"s.acc"'::regclass, 8, false)`)).toBeNull();
  });
});

describe.runIf(needs('DATABASE_URL'))('migration 0008 beside a purge of an earlier release (real Postgres)', () => {
  it('a purge that commits while the migration runs keeps its floor: the copy waits for it', async () => {
    const test = await postgresDatabase();
    const purger = postgres(test.url as string, { max: 1, onnotice: () => {} });
    const migrator = postgres(test.url as string, { max: 1, onnotice: () => {} });
    try {
      const tags = journal.entries.map((e) => e.tag);
      for (const tag of tags.slice(0, tags.indexOf('0008_floors_by_table'))) {
        for (const s of statements(tag)) await migrator.unsafe(s);
      }
      await migrator.unsafe(
        'create table acc (id text primary key, last_fence bigint not null default 0, deleted_at timestamptz)',
      );
      await migrator.unsafe(`insert into palisade.tombstone_floors (table_name, floor) values ('acc', 5)`);
      // An earlier release's purge, raising the floor by name, not yet committed.
      await purger.unsafe('begin');
      await purger.unsafe(`insert into palisade.tombstone_floors (table_name, floor) values ('acc', 9)
        on conflict (table_name) do update set floor = greatest(palisade.tombstone_floors.floor, excluded.floor)`);
      const migrated = migrator.begin(async (tx) => {
        for (const s of statements('0008_floors_by_table')) await tx.unsafe(s);
      });
      // Bounded: until the migration waits on a lock, then the purge commits.
      let waiting = false;
      for (let i = 0; i < 200 && !waiting; i++) {
        const [row] = await purger.unsafe(
          `select count(*)::int as n from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'`,
        );
        waiting = (row?.n as number) > 0;
        if (!waiting) await new Promise((resolve) => setTimeout(resolve, 25));
      }
      expect(waiting).toBe(true);
      await purger.unsafe('commit');
      await migrated;
      const rows = await migrator.unsafe(
        'select fenced_table::text as t, floor::text as floor from palisade.tombstone_floors',
      );
      expect(rows.map((r) => ({ ...r }))).toEqual([{ t: 'acc', floor: '9' }]);
    } finally {
      await purger.end({ timeout: 5 });
      await migrator.end({ timeout: 5 });
      await test.close();
    }
  });
});
