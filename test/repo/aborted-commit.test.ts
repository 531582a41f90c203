/**
 * A transaction palisade runs whose function catches the error of a failed
 * statement and returns: Postgres has aborted the transaction and answers
 * its COMMIT with a rollback, so nothing was written — the call must not
 * report it applied. node-postgres resolves such a COMMIT as a success;
 * postgres.js rejects with the statement's error.
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterEach, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { nodePostgresDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

const drivers = [
  { name: 'postgres.js', open: postgresDatabase },
  { name: 'node-postgres', open: nodePostgresDatabase },
] as const;

for (const { name, open } of drivers) {
  describe.runIf(needs('DATABASE_URL'))(`${name}: a function that catches a failed statement's error`, () => {
    const opened: TestDatabase[] = [];
    const closing: { close(): Promise<void> }[] = [];
    afterEach(async () => {
      await Promise.all(closing.splice(0).map((c) => c.close()));
      await Promise.all(opened.splice(0).map((t) => t.close()));
    });
    async function fresh() {
      const t = await open({ max: 4 });
      opened.push(t);
      const db: Database = t.db;
      await migrate(db);
      await execute(
        db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(db, sql`insert into resource (id, value) values (1, 'initial')`);
      const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('aborted') });
      closing.push(locks);
      const values = async () => (await execute(db, sql`select value from resource`)).map((r) => r.value);
      return { db, locks, repo: fencedRepository(db, resource), values };
    }

    it('fencedTransaction rejects with a DatabaseError and nothing is visible, never applied', async () => {
      const { db, locks, repo, values } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 30_000 });
      const outcome = await fencedTransaction(db, lease, async (tx) => {
        expect((await repo.with(lease).update({ id: 1 }, { value: 'written' })).status).toBe('applied');
        await execute(tx, sql`select 1 / 0`).catch(() => {});
        return 'done';
      }).catch((err: unknown) => err);
      expect(outcome).toBeInstanceOf(DatabaseError);
      expect(await values()).toEqual(['initial']);
      // The pool's connections are fine after it: a new transaction of the same lease applies.
      expect(
        await fencedTransaction(db, lease, async () => repo.with(lease).update({ id: 1 }, { value: 'again' })),
      ).toMatchObject({ status: 'applied' });
      expect(await values()).toEqual(['again']);
      await lease.release();
    });

    it('a lock-scoped modify rejects with a DatabaseError and the row keeps its value', async () => {
      const { locks, repo, values } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 30_000 });
      const outcome = await repo
        .with(lease)
        .modify({ id: 1 }, async (_row, tx) => {
          await execute(tx, sql`select 1 / 0`).catch(() => {});
          return { value: 'modified' };
        })
        .catch((err: unknown) => err);
      expect(outcome).toBeInstanceOf(DatabaseError);
      expect(await values()).toEqual(['initial']);
      await lease.release();
    });
  });
}
