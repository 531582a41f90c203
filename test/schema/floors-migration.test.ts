/**
 * Migration 0008 moves tombstone floors from a key by name (`schema.name` or
 * `name`, unquoted) to a key by table (`regclass`). An old name may spell
 * more than one table; every table it can spell must keep the floor, so an
 * upsert after the upgrade refuses at least what it refused before.
 */
import { readFileSync } from 'node:fs';
import { sql } from 'drizzle-orm';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { pgliteDatabase, type TestDatabase } from '../support/databases.js';

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
    // Floors as earlier versions keyed them, by the repository's spelling of the name.
    await run(`insert into palisade.tombstone_floors (table_name, floor) values
      ('acc', 5), ('s.acc', 7), ('Mixed', 9), ('dropped_long_ago', 11)`);
    for (const s of statements('0008_floors_by_table')) await run(s);
  });
  afterAll(() => test?.close());

  it('keeps every floor on each table its old name can spell, and none for a table that is gone', async () => {
    const rows = await run(
      'select fenced_table::text as t, floor::text as floor from palisade.tombstone_floors order by 1',
    );
    expect(rows).toEqual([
      { t: '"Mixed"', floor: '9' },
      { t: '"s.acc"', floor: '7' },
      { t: 'acc', floor: '5' },
      { t: 's.acc', floor: '7' },
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
