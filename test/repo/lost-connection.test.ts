/**
 * A transaction whose connection the server closed (README, "When the
 * connection closes inside a transaction"): both drivers would end the
 * process there — postgres.js when anything more is sent on the connection,
 * node-postgres when the checked-out client's `error` goes unheard — so the
 * call rejects with a `DatabaseError`, later statements on the transaction
 * reject, nothing it wrote is visible and the process lives on. The
 * function is held at a gate until the driver has seen the close (on
 * postgres.js the call has rejected, on node-postgres the client has
 * ended), so the close is processed before it goes on — in every run, not by
 * luck of timing. Last, the LISTEN connection a lock manager checks out of a
 * node-postgres pool, closed by the server.
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, PalisadeError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { LeasedRepository } from '../../src/repo/repository-api.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { nodePostgresDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

function gate() {
  let open = () => {};
  const opened = new Promise<void>((resolve) => {
    open = resolve;
  });
  return { open, opened };
}

/** A fresh database on `open`'s driver: palisade migrated, rows 1 and 2 of `resource` at 'initial'. */
async function scenario(open: () => Promise<TestDatabase>): Promise<TestDatabase> {
  const t = await open();
  await migrate(t.db);
  await execute(
    t.db,
    sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
  );
  await execute(t.db, sql`insert into resource (id, value) values (1, 'initial'), (2, 'initial')`);
  return t;
}

// How the test knows the driver has seen the close. postgres.js races a transaction with its connection's
// close: the call rejects. node-postgres lets the transaction's function go on: its client has ended.
const drivers = [
  { name: 'postgres.js', open: postgresDatabase, seen: (call: Promise<unknown>) => call },
  {
    name: 'node-postgres',
    open: nodePostgresDatabase,
    seen: (_call: Promise<unknown>, tx: Database) =>
      new Promise((resolve) =>
        (tx as unknown as { session: { client: { once(e: 'end', l: () => void): void } } }).session.client.once(
          'end',
          () => resolve(undefined),
        ),
      ),
  },
] as const;

/** Ends one backend from another session, as an operator or a failover would. */
async function terminate(db: Database, pid: number) {
  await execute(db, sql`select pg_terminate_backend(${pid})`);
}

async function backendPid(tx: Database): Promise<number> {
  const [row] = await execute(tx, sql`select pg_backend_pid() as pid`);
  return Number(row?.pid);
}

/** Until backend `pid()` waits on `event` (a statement in flight there); bounded. */
async function untilWaiting(db: Database, pid: () => number, event: string) {
  for (let i = 0; i < 500; i++) {
    const [row] = await execute(
      db,
      sql`select count(*)::int as n from pg_stat_activity where pid = ${pid()} and wait_event = ${event}`,
    );
    if (row?.n === 1) return;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new Error(`backend never waited on ${event}`);
}

const settled = (call: Promise<unknown>) =>
  call.then(
    () => 'resolved',
    (err: unknown) => err,
  );

// What the function does once its connection is gone.
const afterClose: Record<string, (leased: LeasedRepository<typeof resource>, tx: Database) => Promise<string>> = {
  'writes through palisade': async (leased) => {
    await leased.update({ id: 2 }, { value: 'late' });
    return 'wrote';
  },
  'writes through drizzle itself': async (_leased, tx) => {
    await tx.execute(sql`update resource set value = 'late' where id = 2`);
    return 'wrote';
  },
  'opens a savepoint through drizzle': async (_leased, tx) => {
    await tx.transaction(async (inner) => inner.execute(sql`update resource set value = 'late' where id = 2`));
    return 'wrote';
  },
  throws: async () => {
    throw new Error('the function gave up');
  },
  returns: async () => 'done',
};

for (const { name, open, seen } of drivers) {
  describe.runIf(needs('DATABASE_URL'))(`${name}: a transaction whose connection the server closed`, () => {
    for (const [what, act] of Object.entries(afterClose)) {
      it(`fencedTransaction: closed by pg_terminate_backend, then the function ${what}: the call rejects, the process lives, nothing is visible`, async () => {
        const t = await scenario(open);
        try {
          const { db } = t;
          const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('lost') });
          const lease = await locks.acquire('L', { ttlMs: 60_000 });
          const repo = fencedRepository(db, resource);
          const inside = gate();
          const resume = gate();
          let pid = 0;
          let closed: Promise<unknown> = Promise.resolve();
          const call = fencedTransaction(db, lease, async (tx) => {
            expect((await repo.with(lease).update({ id: 1 }, { value: 'written' })).status).toBe('applied');
            pid = await backendPid(tx);
            closed = seen(outcome, tx);
            inside.open();
            await resume.opened;
            return act(repo.with(lease), tx);
          });
          const outcome = settled(call);
          await inside.opened;
          await terminate(db, pid);
          await closed;
          resume.open();
          const err = await outcome;
          expect(err).toBeInstanceOf(DatabaseError);
          // Had the driver been left to end the process, it would have within these turns of the event loop.
          for (let i = 0; i < 5; i++) await new Promise((r) => setTimeout(r, 10));
          expect((await repo.get({ id: 1 }))?.value).toBe('initial');
          expect((await repo.get({ id: 2 }))?.value).toBe('initial');
          // The pool has connections to give again, and the lock's next grant goes through.
          await lease.release();
          const next = await locks.acquire('L', { ttlMs: 60_000, waitMs: 10_000 });
          expect((await repo.with(next).update({ id: 1 }, { value: 'next' })).status).toBe('applied');
          await next.release();
        } finally {
          await t.close();
        }
      });
    }

    it("modify: a statement through palisade after the close rejects with a PalisadeError, and the function's patch is not written", async () => {
      const t = await scenario(open);
      try {
        const { db } = t;
        const repo = fencedRepository(db, resource);
        const inside = gate();
        const resume = gate();
        let pid = 0;
        let closed: Promise<unknown> = Promise.resolve();
        let late: unknown;
        const call = repo.modify({ id: 1 }, toFence(5n), async (_row, tx) => {
          pid = await backendPid(tx);
          closed = seen(outcome, tx);
          inside.open();
          await resume.opened;
          late = await settled(execute(tx, sql`select 1`));
          return { value: 'modified' };
        });
        const outcome = settled(call);
        await inside.opened;
        await terminate(db, pid);
        await closed;
        resume.open();
        expect(await outcome).toBeInstanceOf(DatabaseError);
        for (let i = 0; i < 50 && late === undefined; i++) await new Promise((r) => setTimeout(r, 10));
        expect(late).toBeInstanceOf(PalisadeError);
        expect((late as PalisadeError).code).toBe('database');
        expect((await repo.get({ id: 1 }))?.value).toBe('initial');
      } finally {
        await t.close();
      }
    });

    it("a statement in flight in the caller's own drizzle savepoint when the connection is killed: the call rejects, the process lives", async () => {
      const t = await scenario(open);
      try {
        const { db } = t;
        const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('sp') });
        const lease = await locks.acquire('L', { ttlMs: 60_000 });
        let pid = 0;
        const call = fencedTransaction(db, lease, async (tx) => {
          pid = await backendPid(tx);
          await tx.execute(sql`update resource set value = 'outer' where id = 1`);
          return tx.transaction(async (inner) => {
            await inner.execute(sql`update resource set value = 'inner' where id = 2`);
            await inner.execute(sql`select pg_sleep(30)`);
          });
        });
        const outcome = settled(call);
        await untilWaiting(db, () => pid, 'PgSleep');
        await terminate(db, pid);
        expect(await outcome).toBeInstanceOf(DatabaseError);
        for (let i = 0; i < 5; i++) await new Promise((r) => setTimeout(r, 10));
        expect((await fencedRepository(db, resource).get({ id: 1 }))?.value).toBe('initial');
        expect((await fencedRepository(db, resource).get({ id: 2 }))?.value).toBe('initial');
      } finally {
        await t.close();
      }
    });

    for (const nested of ['modify', 'upsert', 'updateWhere'] as const) {
      it(`a palisade ${nested} nested in fencedTransaction, in flight when the connection is killed, rejects too: the function's own code goes on`, async () => {
        const t = await scenario(open);
        try {
          const { db } = t;
          // Row 2's writes wait in a trigger, so the nested call is in flight when the kill comes.
          await execute(
            db,
            sql.raw(`create function slow() returns trigger language plpgsql as $$
              begin if new.id = 2 then perform pg_sleep(30); end if; return new; end $$;
              create trigger slow before update or insert on resource for each row execute function slow()`),
          );
          const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('nested') });
          const lease = await locks.acquire('L', { ttlMs: 60_000 });
          const repo = fencedRepository(db, resource);
          const leased = repo.with(lease);
          let pid = 0;
          let inner: unknown;
          const call = fencedTransaction(db, lease, async (tx) => {
            pid = await backendPid(tx);
            await leased.update({ id: 1 }, { value: 'written' });
            const write =
              nested === 'modify'
                ? repo.modify({ id: 2 }, lease.fence, async () => ({ value: 'nested' }))
                : nested === 'upsert'
                  ? leased.upsert({ id: 2, value: 'nested' })
                  : leased.updateWhere(sql`id = 2`, { value: 'nested' }, { allOrNothing: true });
            inner = await settled(write);
            return 'done';
          });
          const outcome = settled(call);
          await untilWaiting(db, () => pid, 'PgSleep');
          await terminate(db, pid);
          expect(await outcome).toBeInstanceOf(DatabaseError);
          for (let i = 0; i < 100 && inner === undefined; i++) await new Promise((r) => setTimeout(r, 10));
          expect(inner).toBeInstanceOf(DatabaseError);
          expect((await repo.get({ id: 1 }))?.value).toBe('initial');
          expect((await repo.get({ id: 2 }))?.value).toBe('initial');
        } finally {
          await t.close();
        }
      });
    }

    it('fencedTransaction: the idle timeout closes a transaction left idle, and the holder process lives on', async () => {
      const t = await scenario(open);
      try {
        const { db } = t;
        const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('idle') });
        const lease = await locks.acquire('L', { ttlMs: 60_000 });
        const repo = fencedRepository(db, resource);
        const inside = gate();
        const resume = gate();
        let closed: Promise<unknown> = Promise.resolve();
        const call = fencedTransaction(
          db,
          lease,
          async (tx) => {
            await repo.with(lease).update({ id: 1 }, { value: 'written' });
            closed = seen(outcome, tx);
            inside.open();
            await resume.opened;
            await repo.with(lease).update({ id: 1 }, { value: 'again' });
            return 'done';
          },
          { idleTimeoutMs: 50 },
        );
        const outcome = settled(call);
        // The server ends the session 50 ms after the function went idle; the test waits for the driver to see it.
        await inside.opened;
        await closed;
        resume.open();
        expect(await outcome).toBeInstanceOf(DatabaseError);
        for (let i = 0; i < 5; i++) await new Promise((r) => setTimeout(r, 10));
        expect((await repo.get({ id: 1 }))?.value).toBe('initial');
        await lease.release();
      } finally {
        await t.close();
      }
    });
  });
}

describe.runIf(needs('DATABASE_URL'))(
  "node-postgres: the lock manager's LISTEN connection, closed by the server",
  () => {
    const listening = async (db: Database, except: number[]) =>
      (
        await execute(
          db,
          sql`select pid from pg_stat_activity where datname = current_database() and query like 'listen %' and pid <> pg_backend_pid()`,
        )
      )
        .map((r) => Number(r.pid))
        .filter((pid) => !except.includes(pid));

    it('the process lives, a waiter still gets the lock, and a new LISTEN opens', async () => {
      const t = await scenario(nodePostgresDatabase);
      try {
        const { db } = t;
        const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('listen') });
        const held = await locks.acquire('L', { ttlMs: 60_000 });
        const waiter = locks.acquire('L', { ttlMs: 60_000, waitMs: 30_000 });
        let first: number[] = [];
        for (let i = 0; i < 500 && first.length === 0; i++) {
          first = await listening(db, []);
          if (first.length === 0) await new Promise((r) => setTimeout(r, 20));
        }
        expect(first).toHaveLength(1);
        await terminate(db, first[0] as number);
        let again: number[] = [];
        for (let i = 0; i < 500 && again.length === 0; i++) {
          again = await listening(db, first);
          if (again.length === 0) await new Promise((r) => setTimeout(r, 20));
        }
        expect(again).toHaveLength(1);
        await held.release();
        const next = await waiter;
        expect(next.fence).toBeGreaterThan(held.fence);
        await next.release();
        await locks.close();
      } finally {
        await t.close();
      }
    });
  },
);
