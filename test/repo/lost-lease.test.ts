/**
 * A fenced transaction (or a lock-scoped `modify`) whose lease is lost
 * while its function is busy (README, "Fenced transactions"): the idle timeout cannot end a transaction that
 * runs a long statement, or that goes on sending statements after its lease
 * ran out, and such a holder would keep its lock's register row locked —
 * and every next grant of the lock out — for as long as it stays busy. So a
 * lease's signal that aborts while the function runs ends the transaction's
 * session from another connection of the pool: the call rejects with
 * `LeaseLostError`, nothing it wrote is visible, the next grant goes
 * through. The next acquire waits at most 10 s: with the session left
 * running (a 600 s statement, or statements sent for 10 s) it would fail.
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterEach, describe, expect, it } from 'vitest';
import { type Database, execute, transaction } from '../../src/driver.js';
import { LeaseLostError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { endSession, sessionColumnsSql, sessionOf } from '../../src/repo/session-end.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { nodePostgresDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

const settled = (call: Promise<unknown>) =>
  call.then(
    () => 'resolved',
    (err: unknown) => err,
  );

/** Bounded: until `done()` holds, or 10 s. */
async function until(done: () => Promise<boolean>) {
  for (let i = 0; i < 500 && !(await done()); i++) await sleep(20);
}

/** Until backend `pid()` runs `pg_sleep`. */
async function untilSleeping(db: Database, pid: () => number) {
  await until(async () => {
    const [row] = await execute(
      db,
      sql`select count(*)::int as n from pg_stat_activity where pid = ${pid()} and wait_event = 'PgSleep'`,
    );
    return row?.n === 1;
  });
}

async function values(db: Database): Promise<string[]> {
  return (await execute(db, sql`select value from resource order by id`)).map((r) => String(r.value));
}

const drivers = [
  { name: 'postgres.js', open: postgresDatabase },
  { name: 'node-postgres', open: nodePostgresDatabase },
] as const;

for (const { name, open } of drivers) {
  describe.runIf(needs('DATABASE_URL'))(`${name}: a fenced transaction whose lease is lost while it is busy`, () => {
    const opened: TestDatabase[] = [];
    afterEach(async () => {
      await Promise.all(opened.splice(0).map((t) => t.close()));
    });
    async function fresh() {
      const t = await open();
      opened.push(t);
      const { db } = t;
      await migrate(db);
      await execute(
        db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(db, sql`insert into resource (id, value) values (1, 'initial'), (2, 'initial')`);
      const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('lostlease') });
      return { db, locks, repo: fencedRepository(db, resource) };
    }

    it('lost during a long statement (released): the session ends, the call rejects with LeaseLostError, nothing is visible, the next grant goes through', async () => {
      const { db, locks, repo } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      let pid = 0;
      const outcome = settled(
        fencedTransaction(db, lease, async (tx) => {
          expect((await repo.with(lease).update({ id: 1 }, { value: 'written' })).status).toBe('applied');
          pid = Number((await execute(tx, sql`select pg_backend_pid() as pid`))[0]?.pid);
          await execute(tx, sql`select pg_sleep(600)`);
          return 'done';
        }),
      );
      await untilSleeping(db, () => pid);
      await lease.release();
      expect(await outcome).toBeInstanceOf(LeaseLostError);
      const next = await locks.acquire('L', { ttlMs: 60_000, waitMs: 10_000 });
      expect(await values(db)).toEqual(['initial', 'initial']);
      expect((await repo.with(next).update({ id: 2 }, { value: 'next' })).status).toBe('applied');
      await next.release();
    });

    it('a lock-scoped modify lost while its function runs a long statement: the session ends, the call rejects with LeaseLostError, the row keeps its value, the next grant goes through', async () => {
      const { db, locks, repo } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      let pid = 0;
      const outcome = settled(
        repo.with(lease).modify({ id: 1 }, async (_row, tx) => {
          pid = Number((await execute(tx, sql`select pg_backend_pid() as pid`))[0]?.pid);
          await execute(tx, sql`select pg_sleep(600)`);
          return { value: 'modified' };
        }),
      );
      await untilSleeping(db, () => pid);
      await lease.release();
      expect(await outcome).toBeInstanceOf(LeaseLostError);
      const next = await locks.acquire('L', { ttlMs: 60_000, waitMs: 10_000 });
      expect(await values(db)).toEqual(['initial', 'initial']);
      await next.release();
    });

    it('lost by its TTL while the function goes on sending statements: the next statement fails, the call rejects with LeaseLostError, the next grant goes through', async () => {
      const { db, locks, repo } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 1_500 });
      let sent = 0;
      let stopped: unknown;
      const outcome = settled(
        fencedTransaction(db, lease, async (tx) => {
          expect((await repo.with(lease).update({ id: 1 }, { value: 'written' })).status).toBe('applied');
          // Busy the whole time (never idle for long): at most 2,000 statements, about 10 s.
          for (; sent < 2_000; sent++) {
            try {
              await execute(tx, sql`select 1`);
            } catch (err) {
              stopped = err;
              break;
            }
            await sleep(5);
          }
          return 'done';
        }),
      );
      expect(await outcome).toBeInstanceOf(LeaseLostError);
      expect(lease.signal.aborted).toBe(true);
      const next = await locks.acquire('L', { ttlMs: 60_000, waitMs: 10_000 });
      // Ended by the close, not by the count running out.
      await until(async () => stopped !== undefined);
      expect(stopped).toBeInstanceOf(Error);
      expect(sent).toBeLessThan(2_000);
      expect(await values(db)).toEqual(['initial', 'initial']);
      await next.release();
    });

    it("inside the caller's own transaction a lost lease ends nothing: the caller's transaction goes on, the call rejects with LeaseLostError when the function returns", async () => {
      const { db, locks, repo } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      const after = await transaction(db, async (outer) => {
        const call = settled(
          fencedTransaction(outer, lease, async (tx) => {
            await execute(tx, sql`update resource set value = 'inner' where id = 1`);
            await lease.release();
            // Still the caller's session: statements go on working.
            await sleep(100);
            return (await execute(tx, sql`select 1 as one`))[0]?.one;
          }),
        );
        expect(await call).toBeInstanceOf(LeaseLostError);
        // The savepoint rolled back; the caller's transaction is alive.
        return (await execute(outer, sql`select value from resource where id = 1`))[0]?.value;
      });
      expect(after).toBe('initial');
      expect(
        (await repo.update({ id: 2 }, (await locks.acquire('L', { ttlMs: 60_000 })).fence, { value: 'x' })).status,
      ).toBe('applied');
    });

    it("ends a session only while the same transaction runs in it: not once it ended, whatever the connection's pool does with it", async () => {
      const { db } = await fresh();
      const readSession = (tx: Database) =>
        execute(tx, sql`select ${sessionColumnsSql()}`).then(([row]) => sessionOf(row));
      const done = await transaction(db, readSession);
      expect(done).toBeDefined();
      if (!done) return;
      expect(await endSession(db, done)).toBe(false);
      const ended = await settled(
        transaction(db, async (tx) => {
          const running = await readSession(tx);
          expect(running?.pid).toBeTypeOf('number');
          if (running) expect(await endSession(db, running)).toBe(true);
          await execute(tx, sql`select 1`);
        }),
      );
      expect(ended).toBeInstanceOf(Error);
    });
  });
}
