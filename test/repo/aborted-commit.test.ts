/**
 * A transaction palisade runs whose function catches the error of a failed
 * statement and returns: Postgres has aborted the transaction and answers
 * its COMMIT with a rollback, so nothing was written — the call must not
 * report it applied. node-postgres and PGlite resolve such a COMMIT as a
 * success; postgres.js rejects with the statement's error, but only for a
 * statement that failed while the function ran, outside a savepoint.
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { Statements } from '../../src/aborted-transaction.js';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, InvalidArgumentError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { everyTransactionDriver, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

const drivers = everyTransactionDriver;

for (const { name, open, real } of drivers) {
  describe.runIf(!real || needs('DATABASE_URL'))(`${name}: a function that catches a failed statement's error`, () => {
    const opened: TestDatabase[] = [];
    const closing: { close(): Promise<void> }[] = [];
    // PGlite takes a second or more of CPU to start (test/support/pglite.ts): its tests share one, each
    // with the table made anew and a lock namespace of its own. The real Postgres gives each its database.
    let shared: Promise<TestDatabase> | undefined;
    afterEach(async () => {
      await Promise.all(closing.splice(0).map((c) => c.close()));
      await Promise.all(opened.splice(0).map((t) => t.close()));
    });
    afterAll(async () => {
      await (await shared)?.close();
    });
    async function database(): Promise<Database> {
      if (real) {
        const t = await open({ migrated: true });
        opened.push(t);
        return t.db;
      }
      shared ??= open({ migrated: true });
      const { db } = await shared;
      await execute(db, sql`drop table if exists resource`);
      return db;
    }
    async function fresh() {
      const db = await database();
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

    /** A fenced transaction that writes row 1, then runs `then(tx)`: its outcome (a result or an error), and what is visible after. */
    async function afterWrite(then: (tx: Database, db: Database) => unknown) {
      const { db, locks, repo, values } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 30_000 });
      const outcome = await fencedTransaction(db, lease, async (tx) => {
        expect((await repo.with(lease).update({ id: 1 }, { value: 'written' })).status).toBe('applied');
        await then(tx, db);
        return 'done';
      }).catch((err: unknown) => err);
      const visible = await values();
      await lease.release();
      return { outcome, visible };
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

    it('a failing statement fn did not await, caught: the call rejects and nothing is visible', async () => {
      // Sent, not awaited: it fails after fn returned (before the COMMIT, on the same connection).
      const { outcome, visible } = await afterWrite((tx) => {
        void execute(tx, sql`select 1 / 0`).catch(() => {});
      });
      expect(outcome).toBeInstanceOf(DatabaseError);
      expect(visible).toEqual(['initial']);
    });

    it('a statement that failed in a savepoint never rolled back to: the call rejects, nothing visible', async () => {
      // The savepoint's function returns before its statement fails: nothing rolls back to it
      // (postgres.js). Where drizzle releases the savepoint, the release fails and fn throws that.
      const { outcome, visible } = await afterWrite((tx) =>
        tx.transaction(async (sp) => {
          void execute(sp as unknown as Database, sql`select 1 / 0`).catch(() => {});
        }),
      );
      expect(outcome).toBeInstanceOf(Error);
      expect(visible).toEqual(['initial']);
    });

    it('a statement that failed in a savepoint rolled back to: the transaction goes on and applies', async () => {
      const { db, locks, repo, values } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 30_000 });
      const outcome = await fencedTransaction(db, lease, async (tx) => {
        const caught = await tx
          .transaction(async (sp) => {
            await execute(sp as unknown as Database, sql`select 1 / 0`);
          })
          .catch((err: unknown) => err);
        expect(caught).toBeInstanceOf(Error);
        return repo.with(lease).update({ id: 1 }, { value: 'after the savepoint' });
      });
      expect(outcome).toMatchObject({ status: 'applied' });
      expect(await values()).toEqual(['after the savepoint']);
      await lease.release();
    });

    it('a statement sent by code fn left behind, after it returned: never applied with nothing written', async () => {
      const { db, locks, repo, values } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      // Each delay is a number of microtasks after fn returned: before, during and after palisade's look.
      for (let delay = 0; delay <= 12; delay++) {
        await execute(db, sql`update resource set value = 'initial', last_fence = 0`);
        const outcome = await fencedTransaction(db, lease, async (tx) => {
          await repo.with(lease).update({ id: 1 }, { value: 'written' });
          void (async () => {
            for (let i = 0; i < delay; i++) await null;
            await execute(tx, sql`select 1 / 0`);
          })().catch(() => {});
          return 'done';
        }).catch((err: unknown) => err);
        const applied = (outcome as { status?: unknown }).status === 'applied';
        expect({ delay, applied, values: await values() }).toEqual({
          delay,
          applied,
          values: [applied ? 'written' : 'initial'],
        });
      }
      await lease.release();
    });

    it('a statement sent while palisade waits for one fn left running: never applied with nothing written', async () => {
      const { outcome, visible } = await afterWrite((tx) => {
        void execute(tx, sql`select pg_sleep(0.3)`).catch(() => {});
        setTimeout(() => {
          void execute(tx, sql.raw('do $$ begin perform pg_sleep(0.2); perform 1 / 0; end $$')).catch(() => {});
        }, 100);
      });
      const applied = (outcome as { status?: unknown }).status === 'applied';
      expect(visible).toEqual([applied ? 'written' : 'initial']);
    });

    it('a caught failure of class 08 raised on a live session (a remote link down): rejects, nothing visible', async () => {
      const linkDown = sql.raw("do $$ begin raise exception 'link down' using errcode = '08006'; end $$");
      const caught = await afterWrite((tx) => execute(tx, linkDown).catch(() => {}));
      // Left running by a savepoint's function that returned: nothing rolls back to it.
      const inSavepoint = await afterWrite((tx) =>
        tx.transaction(async (sp) => {
          void execute(sp as unknown as Database, linkDown).catch(() => {});
        }),
      );
      for (const { outcome, visible } of [caught, inSavepoint]) {
        expect(outcome).toBeInstanceOf(Error);
        expect(visible).toEqual(['initial']);
      }
    });

    it('a class 08 or 57P01 ERROR a live session raised, caught in a nested fenced transaction that rolled back: the outer one commits', async () => {
      for (const state of ['08006', '57P01']) {
        const raised = sql.raw(`do $$ begin raise exception 'link down' using errcode = '${state}'; end $$`);
        const { db, locks, repo, values } = await fresh();
        const lease = await locks.acquire('L', { ttlMs: 30_000 });
        const outcome = await fencedTransaction(db, lease, async () => {
          // Nested: a savepoint of the outer transaction, rolled back to when its function failed.
          const inner = fencedTransaction(db, lease, async (tx) => execute(tx, raised));
          expect(await inner.catch((err: unknown) => err)).toBeInstanceOf(DatabaseError);
          return repo.with(lease).update({ id: 1 }, { value: 'written' });
        }).catch((err: unknown) => err);
        expect(outcome, state).toMatchObject({ status: 'applied' });
        expect(await values()).toEqual(['written']);
        await lease.release();
      }
    });

    it('a modify and a nested fencedTransaction whose function caught a 40001 reject as retryable', async () => {
      const { db, locks, repo, values } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      const conflict = sql.raw("do $$ begin raise exception 'conflict' using errcode = '40001'; end $$");
      const modified = await repo
        .with(lease)
        .modify({ id: 1 }, async (_row, tx) => {
          await execute(tx, conflict).catch(() => {});
          return { value: 'modified' };
        })
        .catch((err: unknown) => err);
      expect(modified).toMatchObject({ code: 'retryable' });
      const nested = await fencedTransaction(db, lease, async (tx) => {
        const inner = await fencedTransaction(tx, lease, async (inTx) => {
          await execute(inTx, conflict).catch(() => {});
          return 'inner';
        }).catch((err: unknown) => err);
        expect(inner).toMatchObject({ code: 'retryable' });
        return repo.with(lease).update({ id: 1 }, { value: 'after the inner one' });
      });
      expect(nested).toMatchObject({ status: 'applied' });
      expect(await values()).toEqual(['after the inner one']);
      await lease.release();
    });

    it('a failure undone by a hand-written rollback to savepoint: postgres.js rejects (its own rule), the others apply', async () => {
      const { outcome, visible } = await afterWrite(async (tx) => {
        await execute(tx, sql`savepoint mine`);
        await execute(tx, sql`select 1 / 0`).catch(() => {});
        await execute(tx, sql`rollback to savepoint mine`);
      });
      if (name === 'postgres.js') {
        expect(outcome).toBeInstanceOf(DatabaseError);
        expect(visible).toEqual(['initial']);
      } else {
        expect(outcome).toMatchObject({ status: 'applied' });
        expect(visible).toEqual(['written']);
      }
    });

    // Where palisade watches the transaction's statements (node-postgres hands a late one to the client as it is).
    if (name === 'postgres.js' || name === 'PGlite')
      it('a statement sent on the transaction after the call settled is refused with InvalidArgumentError', async () => {
        const { db, locks, repo, values } = await fresh();
        const lease = await locks.acquire('L', { ttlMs: 30_000 });
        let kept: Database | undefined;
        const outcome = await fencedTransaction(db, lease, async (tx) => {
          kept = tx;
          return repo.with(lease).update({ id: 1 }, { value: 'written' });
        });
        expect(outcome).toMatchObject({ status: 'applied' });
        const late = await execute(kept as Database, sql`update resource set value = 'late'`).catch((e: unknown) => e);
        expect(late).toBeInstanceOf(InvalidArgumentError);
        expect(await values()).toEqual(['written']);
        await lease.release();
      });

    // Where palisade guards the transaction's connection (a pool): a single Client's own session is the one ended.
    if (name === 'postgres.js' || name === 'node-postgres')
      it('fn catches the error of its session being ended: the call rejects, nothing is visible, the process goes on', async () => {
        const { outcome, visible } = await afterWrite(async (tx, db) => {
          const [row] = await execute(tx, sql`select pg_backend_pid() as pid`);
          const ending = execute(db, sql`select pg_terminate_backend(${Number(row?.pid)}::int)`);
          await execute(tx, sql`select pg_sleep(5)`).catch(() => {});
          await ending;
        });
        expect(outcome).toBeInstanceOf(DatabaseError);
        expect(visible).toEqual(['initial']);
      });

    it('a caught serialization failure still rejects as retryable, a caught unique violation with its SQLSTATE', async () => {
      const serialization = sql.raw("do $$ begin raise exception 'conflict' using errcode = '40001'; end $$");
      for (const [failing, expected] of [
        [serialization, { code: 'retryable' }],
        [sql`insert into resource (id, value) values (1, 'again')`, { code: 'database', sqlState: '23505' }],
      ] as const) {
        const { outcome, visible } = await afterWrite((tx) => execute(tx, failing).catch(() => {}));
        expect(outcome).toMatchObject(expected);
        expect(visible).toEqual(['initial']);
      }
    });
  });
}

describe('the statements of a transaction, watched', () => {
  it('looks at statements not yet run a bounded number of times, however many are sent before any runs', async () => {
    const statements = new Statements();
    let looks = 0;
    const n = 4_096;
    for (let i = 0; i < n; i++) {
      statements.sent({
        get executed() {
          looks++;
          return false;
        },
        // biome-ignore lint/suspicious/noThenProperty: a stand-in for a postgres.js query, which is a thenable.
        then: () => undefined,
      });
    }
    // Amortised: each look at least doubles what is left to look at next time.
    expect(looks).toBeLessThanOrEqual(2 * n);
    expect(looks).toBeGreaterThan(0);
  });
});
