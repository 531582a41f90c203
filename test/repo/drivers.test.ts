/**
 * What differs between drizzle's Postgres drivers, proven on each: node-postgres
 * names prepared statements as it is told (and Postgres truncates names to 63
 * bytes), and a driver palisade does not support is refused up front.
 */
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { drizzle as drizzleProxy } from 'drizzle-orm/pg-proxy';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, driverOf } from '../../src/driver.js';
import { InvalidArgumentError } from '../../src/errors.js';
import { toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { statementName } from '../../src/prepared.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { mustApply } from '../../src/repo/result.js';
import { drivers, nodePostgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { accountsTable } from './fixtures.js';

const f = toFence;

describe('statement names', () => {
  it('fit in 63 bytes and differ whenever the statement differs, however long the shape key', () => {
    const key = `update:${'a_very_long_table_name_'.repeat(8)}:set(balance,owner,meta,closed_at)`;
    const a = statementName(key, 'update "t" set "balance" = $1');
    const b = statementName(key, 'update "t" set "owner" = $1');
    const c = statementName(`${key}x`, 'update "t" set "balance" = $1');
    for (const name of [a, b, c]) expect(Buffer.byteLength(name)).toBeLessThanOrEqual(63);
    expect(new Set([a, b, c]).size).toBe(3);
    expect(statementName(key, 'update "t" set "balance" = $1')).toBe(a);
  });
});

describe('unsupported drivers', () => {
  it('fencedRepository refuses a drizzle driver palisade does not support before any query', () => {
    const sent: string[] = [];
    const proxy = drizzleProxy(async (text) => {
      sent.push(text);
      return { rows: [] };
    }) as unknown as Database;
    expect(driverOf(proxy)).toBeUndefined();
    const table = accountsTable('accounts_proxy');
    expect(() => fencedRepository(proxy, table)).toThrow(InvalidArgumentError);
    expect(() => fencedRepository(proxy, table)).toThrow(
      /postgres-js, node-postgres or pglite \(got a PgRemoteSession\)/,
    );
    expect(() => fencedRepository({} as Database, table)).toThrow(InvalidArgumentError);
    expect(() => fencedRepository(undefined as unknown as Database, table)).toThrow(InvalidArgumentError);
    expect(sent).toEqual([]);
  });

  it.each(drivers)('accepts $name, and its transactions', async ({ name, open }) => {
    const test = await open();
    try {
      expect(driverOf(test.db)).toBe(name === 'postgres' ? 'postgres-js' : name);
      await test.db.transaction(async (tx) => {
        expect(driverOf(tx)).toBe(name === 'postgres' ? 'postgres-js' : name);
      });
    } finally {
      await test.close();
    }
  });
});

describe.runIf(needs('DATABASE_URL'))('node-postgres on one connection (real Postgres)', () => {
  let test: TestDatabase;
  let client: pg.Client;
  let db: Database;

  beforeAll(async () => {
    test = await nodePostgresDatabase();
    client = new pg.Client({ connectionString: test.url });
    await client.connect();
    db = drizzleNodePostgres(client) as unknown as Database;
    await migrate(db); // upserts read palisade's tombstone floor
  });
  afterAll(async () => {
    await client?.end();
    await test?.close();
  });

  // Regression: statement names were the shape keys; pg warned "Postgres only supports 63
  // characters for query names" and the second different write on a connection failed
  // with 42P05 "prepared statement … already exists".
  it('every write shape on a long-named table applies, each prepared once on the connection', async () => {
    const name = `accounts_with_a_name_long_enough_to_push_shape_keys_past_63_${Date.now()}`.slice(0, 63);
    await db.execute(sql`create table ${sql.identifier(name)} (
      id text primary key, owner text not null default 'nobody', balance integer not null default 0,
      meta jsonb, closed_at timestamptz, last_fence bigint not null default 0, deleted_at timestamptz)`);
    const repo = fencedRepository(db, accountsTable(name));
    mustApply(await repo.upsert({ id: 'a', owner: 'ann', balance: 1 }, f(1)));
    mustApply(await repo.upsert({ id: 'b', owner: 'bob', balance: 1 }, f(1)));
    mustApply(await repo.update({ id: 'a' }, f(2), { balance: 2 }));
    mustApply(await repo.update({ id: 'a' }, f(3), { owner: 'anna' }));
    mustApply(await repo.update({ id: 'a' }, f(4), { balance: 3, owner: 'ann' }));
    expect(await repo.update({ id: 'a' }, f(3), { balance: 9 })).toEqual({ status: 'stale', currentFence: 4n });
    mustApply(await repo.modify({ id: 'b' }, f(5), (row) => ({ balance: row.balance + 1 })));
    expect(await repo.updateWhere(sql`true`, f(6), { balance: 7 })).toEqual({ applied: 2, stale: 0 });
    mustApply(await repo.delete({ id: 'b' }, f(7)));
    // The same shapes again: the named statements are reused, not re-created.
    mustApply(await repo.update({ id: 'a' }, f(8), { balance: 8 }));
    mustApply(await repo.upsert({ id: 'c', owner: 'cy', balance: 1 }, f(8)));
    expect((await repo.get({ id: 'a' }))?.balance).toBe(8);
    expect(await repo.get({ id: 'b' })).toBeUndefined();

    const { rows } = await client.query<{ name: string }>('select name from pg_prepared_statements');
    const names = rows.map((r) => r.name).filter((n) => n.startsWith('palisade_'));
    expect(names.length).toBeGreaterThan(3);
    expect(new Set(names).size).toBe(names.length);
    for (const n of names) expect(Buffer.byteLength(n)).toBeLessThanOrEqual(63);
  });

  it('a placeholder used several times is one parameter: the fence of an update is sent once', async () => {
    const name = `accounts_params_${Date.now()}`;
    await db.execute(sql`create table ${sql.identifier(name)} (
      id text primary key, owner text not null default 'nobody', balance integer not null default 0,
      meta jsonb, closed_at timestamptz, last_fence bigint not null default 0, deleted_at timestamptz)`);
    const repo = fencedRepository(db, accountsTable(name));
    mustApply(await repo.upsert({ id: 'a', owner: 'ann', balance: 1 }, f(1)));
    mustApply(await repo.update({ id: 'a' }, f(2), { balance: 2 }, { returning: 'status' }));
    const { rows } = await client.query<{ statement: string; parameter_types: string }>(
      `select statement, parameter_types::text from pg_prepared_statements
       where name like 'palisade_%' and statement like $1`,
      [`update "${name}"%`],
    );
    expect(rows).toHaveLength(1);
    const [update] = rows as [{ statement: string; parameter_types: string }];
    // balance, fence, id — the fence in SET and in WHERE is the same $2.
    expect(update.parameter_types).toBe('{integer,bigint,text}');
    expect(update.statement.match(/\$2/g)).toHaveLength(2);
    expect((await repo.get({ id: 'a' }))?.lastFence).toBe(2n);
  });
});
