import { randomBytes } from 'node:crypto';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { expect } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import type { Lease } from '../../src/fencing/lease.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { postgresDatabase, type TestDatabase } from './databases.js';

/**
 * A fresh real-Postgres database for a multi-process scenario: palisade
 * migrated, a `resource` row (id 1, fence 0) and an `occupancy`
 * counter that workers raise while inside a critical section.
 */
export async function scenarioDatabase(): Promise<TestDatabase> {
  const test = await postgresDatabase({ migrated: true });
  await test.db.execute(
    sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
  );
  await test.db.execute(sql`insert into resource (id, value) values (1, 'initial')`);
  await test.db.execute(sql`create table occupancy (id int primary key, inside int not null)`);
  await test.db.execute(sql`insert into occupancy values (1, 0)`);
  return test;
}

/** The scenario database's `resource` table. */
export const resource = pgTable('resource', {
  id: integer('id').primaryKey(),
  value: text('value'),
  ...fenceColumns(),
});

/** Creates {@link resource} on `db`, rows 1…`rows` at 'initial' and fence 0. */
export async function createResource(db: Database, rows: number): Promise<void> {
  await execute(
    db,
    sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
  );
  await execute(db, sql`insert into resource (id, value) select g, 'initial' from generate_series(1, ${rows}) g`);
}

/**
 * `resource` rows a suite inserts for its own tests (ids from 100, beside the workers' row 1), each at
 * fence 0, and how it reads one back. `scenario` is read at each call (suites open it in `beforeAll`).
 */
export function scenarioRows(scenario: () => TestDatabase) {
  return {
    // The next id above every row there (from 100): helpers and the suite draw rows from one database.
    async newRow(): Promise<number> {
      const [row] = await execute(
        scenario().db,
        sql`insert into resource (id, value) select greatest(coalesce(max(id), 0), 99) + 1, 'initial' from resource returning id`,
      );
      return Number(row?.id);
    },
    async rowOf(id: number) {
      const [row] = await scenario().db.select().from(resource).where(sql`${resource.id} = ${id}`);
      return row;
    },
  };
}

/**
 * Lock scope across rows, on two fresh `resource` rows: the newer holder writes the first; the stale
 * holder, woken after it and never told it lost the lock, is refused on the second, which stays as it was.
 */
export async function expectStaleRefusedOnUntouchedRow(scenario: TestDatabase, stale: Lease, newer: Lease) {
  const { newRow, rowOf } = scenarioRows(() => scenario);
  const [touched, untouched] = [await newRow(), await newRow()];
  const repo = fencedRepository(scenario.db, resource, { scope: 'lock' });
  expect(await repo.with(newer).update({ id: touched }, { value: 'newer' })).toMatchObject({ status: 'applied' });
  const woken = { fence: stale.fence, lock: stale.lock, signal: new AbortController().signal };
  expect(await repo.with(woken).update({ id: untouched }, { value: 'stale' })).toMatchObject({
    status: 'stale',
    currentFence: newer.fence,
  });
  expect(await rowOf(untouched)).toMatchObject({ value: 'initial' });
}

/** A namespace (or key prefix) no other test uses. */
export function uniqueNamespace(prefix = 't'): string {
  return `${prefix}-${randomBytes(5).toString('hex')}`;
}
