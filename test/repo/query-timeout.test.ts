/**
 * node-postgres's `query_timeout` inside a transaction palisade began: the
 * client gives up on a statement the server goes on running, and then on
 * the driver's ROLLBACK, queued behind it and never sent. The session is
 * still in the transaction: a pool's client goes back broken (the pool
 * closes it, the server rolls back), a single client is ended — never lent
 * on, where the next borrower's COMMIT would keep the given-up writes, or
 * the transaction's end take the borrower's. A write sent on its own that
 * the client gave up on may still commit: `outcomeUnknown`. (README, "When
 * the connection closes inside a transaction".)
 */
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import { integer, pgTable } from 'drizzle-orm/pg-core';
import pg from 'pg';
import { describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, PalisadeError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { postgresDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { withholdingProxy } from '../support/withholding-proxy.js';

const accounts = pgTable('accounts', {
  id: integer('id').primaryKey(),
  balance: integer('balance').notNull(),
  ...fenceColumns(),
});
const [X, Y, W, Z] = [1, 2, 3, 4];
const TIMEOUT_MS = 300;
const holder = (fence: number, name = 'L') => ({
  fence: toFence(fence) as Fence,
  lock: Object.freeze({ kind: 'test', source: 'query-timeout', namespace: uniqueNamespace(), name }),
  signal: new AbortController().signal,
});

const drivers = {
  'a node-postgres pool': (url: string, app: string) => {
    const pool = new pg.Pool({ connectionString: url, max: 1, query_timeout: TIMEOUT_MS, application_name: app });
    pool.on('error', () => {});
    let ended: Promise<void> | undefined;
    return { db: drizzle(pool) as unknown as Database, end: () => (ended ??= pool.end()), connect: async () => {} };
  },
  'a single node-postgres Client': (url: string, app: string) => {
    const client = new pg.Client({ connectionString: url, query_timeout: TIMEOUT_MS, application_name: app });
    client.on('error', () => {});
    let ended: Promise<void> | undefined;
    return {
      db: drizzle(client) as unknown as Database,
      end: () => (ended ??= client.end().catch(() => {})),
      connect: () => client.connect(),
    };
  },
};

interface Setup {
  readonly db: Database;
  readonly url: string;
  /** Another session locks row `id` (FOR UPDATE) until the returned function is called. */
  lockRow(id: number): Promise<() => Promise<void>>;
  /** Every row as `balance@fence`, read on a connection of the test's own. */
  rows(): Promise<string[]>;
  /** Waits (bounded) until no session named `app` is left on the database. */
  gone(app: string): Promise<void>;
  /** Waits (bounded) until no session named `app` runs a statement. */
  idle(app: string): Promise<void>;
  /**
   * A client of `driver` (through `url`, default the database's), named `app` on the server, ended with the
   * test; `settle()` ends it now and waits until its sessions are gone.
   */
  client(driver: keyof typeof drivers, app: string, url?: string): Promise<Own>;
}

interface Own {
  readonly db: Database;
  readonly repo: ReturnType<typeof fencedRepository<typeof accounts>>;
  settle(): Promise<void>;
}

async function withAccounts(fn: (s: Setup) => Promise<void>): Promise<void> {
  const test = await postgresDatabase({ migrated: true });
  const url = test.url as string;
  const lockers: pg.Client[] = [];
  const ends: (() => Promise<void>)[] = [];
  try {
    await execute(
      test.db,
      sql.raw(`create table accounts (id int primary key, balance int not null, last_fence bigint not null default 0,
        deleted_at timestamptz);
        insert into accounts (id, balance) select g, 0 from generate_series(1, 4) g;
        update accounts set balance = 100, last_fence = 100 where id = ${W}`),
    );
    await fn({
      db: test.db,
      url,
      async lockRow(id) {
        const locker = new pg.Client({ connectionString: url });
        lockers.push(locker);
        await locker.connect();
        await locker.query('begin');
        await locker.query('select 1 from accounts where id = $1 for update', [id]);
        return async () => {
          await locker.query('commit');
        };
      },
      async rows() {
        const rows = await execute(test.db, sql`select balance || '@' || last_fence as r from accounts order by id`);
        return rows.map((r) => String(r.r));
      },
      async idle(app) {
        for (let i = 0; i < 200; i++) {
          const [row] = await execute(
            test.db,
            sql`select count(*)::int as n from pg_stat_activity where datname = current_database() and application_name = ${app} and state = 'active'`,
          );
          if (row?.n === 0) return;
          await sleep(20);
        }
        throw new Error(`a session named ${app} stayed active`);
      },
      async client(driver, app, through = url) {
        const own = drivers[driver](through, app);
        ends.push(own.end);
        await own.connect();
        return {
          db: own.db,
          repo: fencedRepository(own.db, accounts),
          settle: async () => {
            await own.end();
            await this.gone(app);
          },
        };
      },
      async gone(app) {
        for (let i = 0; i < 200; i++) {
          const [row] = await execute(
            test.db,
            sql`select count(*)::int as n from pg_stat_activity where datname = current_database() and application_name = ${app}`,
          );
          if (row?.n === 0) return;
          await sleep(50);
        }
        throw new Error(`a session named ${app} stayed`);
      },
    });
  } finally {
    for (const end of ends) await end();
    for (const locker of lockers) await locker.end().catch(() => {});
    await test.close();
  }
}

describe.runIf(needs('DATABASE_URL'))('query_timeout inside a transaction palisade began', { timeout: 60_000 }, () => {
  for (const name of Object.keys(drivers) as (keyof typeof drivers)[]) {
    it(`${name}: the fenced transaction rejects, and nothing it wrote is ever kept — not by the next caller's COMMIT either`, () =>
      withAccounts(async (s) => {
        const { db, repo, settle } = await s.client(name, `qt-${name.length}`);
        const a = holder(41);
        const unlock = await s.lockRow(Y);
        const outcome = await fencedTransaction(db, a, async () => {
          expect((await repo.with(a).update({ id: X }, { balance: 41 })).status).toBe('applied');
          await repo.with(a).update({ id: Y }, { balance: 41 }); // waits for the row lock past query_timeout
        }).catch((err: unknown) => err);
        expect(outcome).toBeInstanceOf(DatabaseError);
        expect((outcome as DatabaseError).outcomeUnknown).toBe(false);
        // The row lock goes: the given-up statement ends on the server. Then the next caller of the same
        // database (another lock).
        await unlock();
        const b = holder(50, 'M');
        const next = await fencedTransaction(db, b, () => repo.with(b).update({ id: Z }, { balance: 50 })).catch(
          (err: unknown) => err,
        );
        const pool = name === 'a node-postgres pool';
        // A pool's fresh connection commits its own write, and only that; the single client was ended: a clear
        // failure, not a write run inside the given-up transaction.
        if (pool) expect(next).toMatchObject({ status: 'applied' });
        else expect(next).toBeInstanceOf(DatabaseError);
        await settle();
        expect(await s.rows()).toEqual(['0@0', '0@0', '100@100', pool ? '50@50' : '0@0']);
      }));

    it(`${name}: a function that catches a statement the client gave up on — the transaction is refused, nothing kept`, () =>
      withAccounts(async (s) => {
        const app = `qt-caught-${name.length}`;
        const { db, repo, settle } = await s.client(name, app);
        const a = holder(41);
        const unlock = await s.lockRow(Y);
        const outcome = await fencedTransaction(db, a, async () => {
          expect((await repo.with(a).update({ id: X }, { balance: 41 })).status).toBe('applied');
          const given = await repo
            .with(a)
            .update({ id: Y }, { balance: 41 })
            .catch((err: unknown) => err);
          expect(given).toBeInstanceOf(DatabaseError);
          // The row lock goes, and the given-up write ends on the server — before the function returns.
          await unlock();
          await s.idle(app);
          return 'went on';
        }).catch((err: unknown) => err);
        // Not committed: the given-up write may still be running on the server. (Refused, or — when the driver's
        // ROLLBACK, queued behind that write, times out too — the ROLLBACK's own failure.)
        expect(outcome).toBeInstanceOf(PalisadeError);
        await settle();
        expect(await s.rows()).toEqual(['0@0', '0@0', '100@100', '0@0']);
      }));
  }

  it('a node-postgres pool: a function that catches the timeout after a stale write gets `stale`, and nothing is kept', () =>
    withAccounts(async (s) => {
      const { db, repo, settle } = await s.client('a node-postgres pool', 'qt-stale');
      const a = holder(41);
      const unlock = await s.lockRow(Y);
      const outcome = await fencedTransaction(db, a, async () => {
        expect((await repo.with(a).update({ id: X }, { balance: 41 })).status).toBe('applied');
        expect((await repo.with(a).update({ id: W }, { balance: 41 })).status).toBe('stale');
        await repo
          .with(a)
          .update({ id: Y }, { balance: 41 })
          .catch(() => 'given up');
      });
      expect(outcome).toMatchObject({ status: 'stale' });
      await unlock();
      const b = holder(50, 'M');
      const next = await fencedTransaction(db, b, () => repo.with(b).update({ id: Z }, { balance: 50 }));
      expect(next).toMatchObject({ status: 'applied' });
      await settle();
      expect(await s.rows()).toEqual(['0@0', '0@0', '100@100', '50@50']);
    }));

  it('a write sent on its own that query_timeout gave up on: outcomeUnknown — the server may still commit it', () =>
    withAccounts(async (s) => {
      const { repo, settle } = await s.client('a node-postgres pool', 'qt-alone');
      const unlock = await s.lockRow(Y);
      const outcome = await repo.update({ id: Y }, toFence(41), { balance: 41 }).catch((err: unknown) => err);
      expect(outcome).toBeInstanceOf(DatabaseError);
      expect((outcome as DatabaseError).outcomeUnknown).toBe(true);
      expect((outcome as DatabaseError).message).toMatch(/whether it committed is unknown/);
      await unlock();
      await settle();
      // Here it did.
      expect((await s.rows())[1]).toBe('41@41');
    }));

  it('a single node-postgres Client whose BEGIN got no answer is ended: the next call fails, nothing runs in that transaction', () =>
    withAccounts(async (s) => {
      const proxy = withholdingProxy(s.url);
      try {
        const { db, repo, settle } = await s.client('a single node-postgres Client', 'qt-begin', await proxy.url());
        const a = holder(41);
        // The server runs the BEGIN; its answer is held back past query_timeout.
        proxy.state.withhold = true;
        const outcome = await fencedTransaction(db, a, () => repo.with(a).update({ id: X }, { balance: 41 })).catch(
          (err: unknown) => err,
        );
        expect(outcome).toBeInstanceOf(DatabaseError);
        proxy.release();
        // Another caller of the same client: refused, not run (and lost) inside the BEGIN's transaction.
        const next = await repo.update({ id: Z }, toFence(50), { balance: 50 }).catch((err: unknown) => err);
        expect(next).toBeInstanceOf(DatabaseError);
        await settle();
        expect(await s.rows()).toEqual(['0@0', '0@0', '100@100', '0@0']);
      } finally {
        proxy.close();
      }
    }));

  it('a Postgres lease grant the client gave up on, which lands later on the server, is given back', () =>
    withAccounts(async (s) => {
      const pool = new pg.Pool({ connectionString: s.url, max: 3, query_timeout: TIMEOUT_MS });
      pool.on('error', () => {});
      const locks = postgresLockManager({
        client: drizzle(pool) as unknown as Database,
        namespace: uniqueNamespace(),
        lockTimeoutMs: 500,
      });
      try {
        // The lock's register row exists, and another session shares it: the next grant, which raises it, waits.
        const first = await locks.acquire('L', { ttlMs: 5_000 });
        await first.release();
        const sharer = new pg.Client({ connectionString: s.url });
        await sharer.connect();
        await sharer.query('begin');
        await sharer.query('select 1 from palisade.lock_registers for share');
        // The client gives up on the grant (query_timeout) long before the server does (its wait: waitMs).
        const outcome = await locks.acquire('L', { ttlMs: 120_000, waitMs: 5_000 }).catch((err: unknown) => err);
        expect(outcome).toBeInstanceOf(DatabaseError);
        // Longer than a release waits for the lease row (lockTimeoutMs), which the waiting grant holds: the give-back
        // sent at once gives up on the server. Then the register row is free, and the grant lands for a token nobody holds.
        await sleep(1_500);
        await sharer.query('commit');
        await sharer.end();
        // Given back: the lock is free again long before that lease's TTL of 120 s (bounded: 200 × 100 ms).
        let again: Awaited<ReturnType<typeof locks.tryAcquire>> = null;
        for (let i = 0; i < 200 && again === null; i++) {
          await sleep(100);
          again = await locks.tryAcquire('L', { ttlMs: 5_000 }).catch(() => null);
        }
        expect(again).not.toBeNull();
        await again?.release();
      } finally {
        await locks.close();
        await pool.end();
      }
    }));
});
