import { integer, pgTable } from 'drizzle-orm/pg-core';
import type postgres from 'postgres';
import { fenceColumns } from '../../src/schema/fence-columns.js';

/** The benchmark's fenced table: an integer key, one integer column, the fence columns. */
export const makeAccounts = (name: string) =>
  pgTable(name, {
    id: integer('id').primaryKey(),
    balance: integer('balance').notNull(),
    ...fenceColumns(),
  });

export type Accounts = ReturnType<typeof makeAccounts>;

/**
 * Creates `name` with `rows` rows (ids 1…rows, fence 0) in one statement,
 * then VACUUM ANALYZE so every table starts with a visibility map and stats.
 */
export async function createAccounts(sql: postgres.Sql, name: string, rows: number): Promise<void> {
  await sql.unsafe(`drop table if exists ${name}`);
  await sql.unsafe(
    `create table ${name} (id integer primary key, balance integer not null,
      last_fence bigint not null default 0, deleted_at timestamptz)`,
  );
  await sql.unsafe(`insert into ${name} (id, balance) select g, 0 from generate_series(1, ${rows}) g`);
  await sql.unsafe(`vacuum analyze ${name}`);
}

/** A fence counter above every fence used so far in the run, so fenced writes apply. */
export class FenceCounter {
  #next: bigint;
  constructor(start = 1n) {
    this.#next = start;
  }
  next(): bigint {
    const f = this.#next;
    this.#next += 1n;
    return f;
  }
}

/** A uniformly random id in 1…n. */
export const randomId = (n: number): number => 1 + Math.floor(Math.random() * n);
