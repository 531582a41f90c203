/**
 * Tables and helpers for the repository suites. Every test creates tables of
 * its own (random names), so suites run in parallel and twice in a row on
 * the same database.
 */
import { randomBytes } from 'node:crypto';
import type { PGlite } from '@electric-sql/pglite';
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { integer, jsonb, pgTable, primaryKey, text, timestamp } from 'drizzle-orm/pg-core';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import type pg from 'pg';
import type { Sql } from 'postgres';
import type { Database } from '../../src/driver.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import type { TestDatabase } from '../support/databases.js';

export function uniqueName(prefix: string): string {
  return `${prefix}_${randomBytes(5).toString('hex')}`;
}

export function accountsTable(name: string) {
  return pgTable(name, {
    id: text('id').primaryKey(),
    owner: text('owner').notNull().default('nobody'),
    balance: integer('balance').notNull().default(0),
    meta: jsonb('meta'),
    closedAt: timestamp('closed_at', { withTimezone: true, mode: 'date' }),
    ...fenceColumns(),
  });
}
export type Accounts = ReturnType<typeof accountsTable>;

/** Creates a fresh `accounts`-shaped table and returns its drizzle definition. */
export async function createAccounts(db: Database): Promise<Accounts> {
  const name = uniqueName('accounts');
  await db.execute(sql`create table ${sql.identifier(name)} (
    id text primary key,
    owner text not null default 'nobody',
    balance integer not null default 0,
    meta jsonb,
    closed_at timestamptz,
    last_fence bigint not null default 0,
    deleted_at timestamptz
  )`);
  return accountsTable(name);
}

export function linesTable(name: string) {
  return pgTable(
    name,
    {
      orderId: text('order_id').notNull(),
      lineNo: integer('line_no').notNull(),
      qty: integer('qty').notNull(),
      ...fenceColumns(),
    },
    (t) => [primaryKey({ columns: [t.orderId, t.lineNo] })],
  );
}
export type Lines = ReturnType<typeof linesTable>;

/** A table with a composite primary key (order_id, line_no). */
export async function createLines(db: Database): Promise<Lines> {
  const name = uniqueName('lines');
  await db.execute(sql`create table ${sql.identifier(name)} (
    order_id text not null,
    line_no integer not null,
    qty integer not null,
    last_fence bigint not null default 0,
    deleted_at timestamptz,
    primary key (order_id, line_no)
  )`);
  return linesTable(name);
}

/** The row exactly as stored, tombstones included, bypassing the repository. */
export async function storedRow(db: Database, table: Accounts, id: string) {
  const [row] = await db.select().from(table).where(sql`${table.id} = ${id}`);
  return row;
}

/**
 * A second drizzle database on the same client that records every statement
 * it sends: proves that a call failed before any query ran.
 */
export function withQueryLog(test: TestDatabase): { db: Database; queries: string[] } {
  const queries: string[] = [];
  const logger = { logQuery: (query: string) => void queries.push(query) };
  const client = (test.db as unknown as { $client: unknown }).$client;
  const db =
    test.driver === 'pglite'
      ? (drizzlePglite(client as PGlite, { logger }) as unknown as Database)
      : test.driver === 'node-postgres'
        ? (drizzleNodePostgres(client as pg.Pool, { logger }) as unknown as Database)
        : (drizzlePostgres(client as Sql, { logger }) as unknown as Database);
  return { db, queries };
}
