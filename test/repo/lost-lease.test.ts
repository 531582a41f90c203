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
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import pg from 'pg';
import { afterEach, describe, expect, it } from 'vitest';
import { type Database, execute, transaction } from '../../src/driver.js';
import { LeaseLostError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { toFence } from '../../src/fencing/fence.js';
import type { Lease } from '../../src/fencing/lease.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { inClaim } from '../../src/repo/lock-scope.js';
import { cancelStatement, type SessionOf, sessionColumnsSql, sessionOf } from '../../src/repo/lost-lease.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { nodePostgresDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { queuedPushes } from '../support/pg-queue.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

function opening() {
  let open = () => {};
  const opened = new Promise<void>((resolve) => {
    open = resolve;
  });
  return { open, opened };
}

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

/**
 * Loses `lease` (released) while its holder's function goes on until `gate` opens: the next grant, waiting
 * at most 5 s, must not need the function to stop; the call rejects with LeaseLostError, nothing is visible.
 */
async function releaseThenGrantWhileItGoesOn({
  db,
  locks,
  lease,
  gate,
  outcome,
}: {
  db: Database;
  locks: { acquire(name: string, options: { ttlMs: number; waitMs: number }): Promise<Lease> };
  lease: Lease;
  gate: { open(): void };
  outcome: Promise<unknown>;
}) {
  await lease.release();
  const next = await locks.acquire('L', { ttlMs: 60_000, waitMs: 5_000 }).catch((err: unknown) => err);
  gate.open();
  expect(next).toHaveProperty('fence');
  expect(await outcome).toBeInstanceOf(LeaseLostError);
  expect(await values(db)).toEqual(['initial', 'initial']);
  await (next as Lease).release();
}

async function values(db: Database): Promise<string[]> {
  return (await execute(db, sql`select value from resource order by id`)).map((r) => String(r.value));
}

// A lock whose grants never claim on these databases (a Redis lock's, say): its first claim raises the register.
const fakeLock = Object.freeze({ kind: 'redis', source: 'lost-lease-test', namespace: 'test', name: 'L' });

const drivers = [
  { name: 'postgres.js', open: postgresDatabase },
  { name: 'node-postgres', open: nodePostgresDatabase },
] as const;

for (const { name, open } of drivers) {
  describe.runIf(needs('DATABASE_URL'))(`${name}: a fenced transaction whose lease is lost while it is busy`, () => {
    const opened: TestDatabase[] = [];
    const managers: { close(): Promise<void> }[] = [];
    afterEach(async () => {
      // Managers first: a node-postgres pool ends only once the connection a waiting acquire listened on is back.
      await Promise.all(managers.splice(0).map((m) => m.close()));
      await Promise.all(opened.splice(0).map((t) => t.close()));
    });
    async function prepare(db: Database) {
      await execute(
        db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(db, sql`insert into resource (id, value) values (1, 'initial'), (2, 'initial')`);
      const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('lostlease') });
      managers.push(locks);
      return { db, locks, repo: fencedRepository(db, resource) };
    }
    async function fresh() {
      const t = await open({ migrated: true });
      opened.push(t);
      return prepare(t.db);
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

    // The function goes on after the loss — in each shape below — until the test opens its gate (or 10 s
    // pass): the next acquire, waiting at most 5 s, must not need it to stop.
    const goesOn: Record<string, (tx: Database, gate: Promise<unknown>) => Promise<unknown>> = {
      'waits for something else (not the database)': async (_tx, gate) => gate,
      'catches its errors in a savepoint, one item after another': async (tx, gate) => {
        let open = false;
        void gate.then(() => {
          open = true;
        });
        for (let i = 0; i < 500 && !open; i++) {
          await tx.transaction(async (sp) => sp.execute(sql`select pg_sleep(0.02)`)).catch(() => {});
          await sleep(20);
        }
      },
    };
    for (const [shape, fn] of Object.entries(goesOn)) {
      it(`lost while the function goes on (${shape}): the transaction is rolled back at once, the next grant goes through`, async () => {
        const { db, locks, repo } = await fresh();
        const lease = await locks.acquire('L', { ttlMs: 60_000 });
        const gate = opening();
        const inside = opening();
        const outcome = settled(
          fencedTransaction(db, lease, async (tx) => {
            expect((await repo.with(lease).update({ id: 1 }, { value: 'written' })).status).toBe('applied');
            inside.open();
            await fn(tx, Promise.race([gate.opened, sleep(10_000)]));
          }),
        );
        await inside.opened;
        await releaseThenGrantWhileItGoesOn({ db, locks, lease, gate, outcome });
      });
    }

    it("a lock-scoped modify whose function catches the cancelled statement's error and goes on: rolled back at once, the next grant goes through", async () => {
      const { db, locks, repo } = await fresh();
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      const gate = opening();
      let pid = 0;
      const outcome = settled(
        repo.with(lease).modify({ id: 1 }, async (_row, tx) => {
          pid = Number((await execute(tx, sql`select pg_backend_pid() as pid`))[0]?.pid);
          await execute(tx, sql`select pg_sleep(600)`).catch(() => {});
          await Promise.race([gate.opened, sleep(10_000)]);
          return { value: 'modified' };
        }),
      );
      await untilSleeping(db, () => pid);
      await releaseThenGrantWhileItGoesOn({ db, locks, lease, gate, outcome });
    });

    it('lost after the last statement of a claimed transaction, before it commits: it rejects with LeaseLostError, never "applied" with its write rolled back', async () => {
      const { db } = await fresh();
      const controller = new AbortController();
      const scope = { lock: fakeLock, idleMs: () => 60_000, ranOut: () => false, signal: controller.signal };
      const outcome = await settled(
        inClaim(
          db,
          scope,
          toFence(7n),
          async (tx) => {
            await execute(tx, sql`update resource set value = 'written' where id = 1`);
            controller.abort();
            return 'applied';
          },
          () => 'refused',
          true,
        ),
      );
      expect(outcome).toBeInstanceOf(LeaseLostError);
      expect(await values(db)).toEqual(['initial', 'initial']);
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

    it('cancels only a statement of that very transaction: not one between its statements, none once it ended', async () => {
      const { db } = await fresh();
      let session: SessionOf | undefined;
      const found: string[] = [];
      let slept: unknown;
      await transaction(db, async (tx) => {
        session = sessionOf((await execute(tx, sql`select ${sessionColumnsSql()}`))[0]);
        if (!session) throw new Error('the statement named no session');
        found.push(await cancelStatement(db, session));
        // Nothing was sent: the transaction's next statement runs.
        await execute(tx, sql`select 1`);
        const sleeping = settled(execute(tx, sql`select pg_sleep(600)`));
        let during = 'idle';
        for (let i = 0; i < 200 && during === 'idle'; i++) {
          await sleep(20);
          during = await cancelStatement(db, session);
        }
        found.push(during);
        slept = await sleeping;
      }).catch(() => {});
      expect(found).toEqual(['idle', 'cancelled']);
      expect(slept).toBeInstanceOf(Error);
      if (session) expect(await cancelStatement(db, session)).toBe('gone');
    });

    it('stopped again and again on a pool of 2: each next grant goes through, and no other query of the pool fails', async () => {
      const t = await open({ max: 2, migrated: true });
      opened.push(t);
      const { db, locks } = await prepare(t.db);
      for (let round = 1; round <= 4; round++) {
        const lease = await locks.acquire(`L${round}`, { ttlMs: 60_000 });
        let pid = 0;
        const outcome = settled(
          fencedTransaction(db, lease, async (tx) => {
            pid = Number((await execute(tx, sql`select pg_backend_pid() as pid`))[0]?.pid);
            await execute(tx, sql`select pg_sleep(600)`);
          }),
        );
        await untilSleeping(db, () => pid);
        await lease.release();
        const next = await locks.acquire(`L${round}`, { ttlMs: 60_000, waitMs: 10_000 });
        expect(await outcome).toBeInstanceOf(LeaseLostError);
        for (let i = 0; i < 4; i++) expect((await execute(db, sql`select 1 as one`))[0]?.one).toBe(1);
        await next.release();
      }
    });

    it('lost as the function returns, 100 times on a pool of 2: LeaseLostError each time, the process lives, the pooled connections stay usable', async () => {
      const t = await open({ max: 2, migrated: true });
      opened.push(t);
      const { db } = await prepare(t.db);
      const outcomes = new Map<string, number>();
      for (let i = 0; i < 100; i++) {
        const controller = new AbortController();
        const holder = { fence: toFence(BigInt(i + 1)), signal: controller.signal, lock: fakeLock };
        const busyUntil = performance.now() + Math.random() * 0.3;
        const outcome = await settled(
          fencedTransaction(db, holder, async (tx) => {
            await execute(tx, sql`select 1`);
            controller.abort();
            while (performance.now() < busyUntil); // the abort's work and the rollback, in every order
          }),
        );
        const name = outcome instanceof Error ? outcome.constructor.name : String(outcome);
        outcomes.set(name, (outcomes.get(name) ?? 0) + 1);
      }
      await sleep(200);
      expect(Object.fromEntries(outcomes)).toEqual({ LeaseLostError: 100 });
      for (let i = 0; i < 20; i++) expect((await execute(db, sql`select 1 as one`))[0]?.one).toBe(1);
    });

    it('16 fenced transactions of one lease at once: one listener on its signal (no leak warning), and its loss stops each', async () => {
      const t = await open({ max: 17, migrated: true }); // one left for the stop's look at the sessions
      opened.push(t);
      const { db } = await prepare(t.db);
      const warnings: string[] = [];
      const onWarning = (w: Error) => warnings.push(w.name);
      process.on('warning', onWarning);
      try {
        const controller = new AbortController();
        const holder = { fence: toFence(1n), signal: controller.signal, lock: fakeLock };
        // The register raised to this fence first: the 16 then share it (a raise holds it to its commit).
        await fencedTransaction(db, holder, async (tx) => execute(tx, sql`select 1`));
        let lastIn = () => {};
        const allIn = new Promise<void>((resolve) => {
          lastIn = resolve;
        });
        let inside = 0;
        const outcomes = Array.from({ length: 16 }, () =>
          settled(
            fencedTransaction(db, holder, async (tx) => {
              await execute(tx, sql`select 1`);
              if (++inside === 16) lastIn();
              await allIn;
              await execute(tx, sql`select pg_sleep(10)`);
            }),
          ),
        );
        await allIn;
        controller.abort();
        for (const outcome of await Promise.all(outcomes)) expect(outcome).toBeInstanceOf(LeaseLostError);
        await sleep(10); // a warning is emitted on the next tick
        expect(warnings).not.toContain('MaxListenersExceededWarning');
      } finally {
        process.off('warning', onWarning);
      }
    });

    for (const max of [1, 5]) {
      it(`lost by its TTL while the function sits idle, on a pool of ${max}: LeaseLostError, whichever of the lease's expiry and the idle timeout comes first`, async () => {
        const t = await open({ max, migrated: true });
        opened.push(t);
        const { db, locks } = await prepare(t.db);
        const lease = await locks.acquire('L', { ttlMs: 1_000 });
        const outcome = await settled(
          fencedTransaction(db, lease, async (tx) => {
            await execute(tx, sql`select 1`);
            await sleep(2_500);
            await execute(tx, sql`select 1`);
          }),
        );
        expect(outcome).toBeInstanceOf(LeaseLostError);
        expect((await execute(db, sql`select 1 as one`))[0]?.one).toBe(1);
      });
    }
  });
}

describe.runIf(needs('DATABASE_URL'))(
  'node-postgres on a single pg.Client: a lost lease fails the call, not the client',
  () => {
    let close = async () => {};
    afterEach(async () => close());

    it('a lost lease stops nothing there; after it the same database runs plain statements, new transactions and lock grants', async () => {
      const t = await nodePostgresDatabase({ max: 1, migrated: true });
      const client = new pg.Client({ connectionString: t.url });
      await client.connect();
      client.on('error', () => {});
      close = async () => {
        await client.end();
        await t.close();
      };
      // drizzle runs a single client's transactions on the database's own session.
      const db = drizzleNodePostgres(client) as unknown as Database;
      const locks = postgresLockManager({ client: t.db, namespace: uniqueNamespace('lostclient') });
      const lost = await locks.acquire('L', { ttlMs: 60_000 });
      // Not stopped there (nothing to refuse with, and a cancel sent on the one connection would run
      // inside the transaction and cancel itself): the function's statements go on until it returns.
      const after: unknown[] = [];
      const first = await settled(
        fencedTransaction(db, lost, async (tx) => {
          await lost.release();
          for (let i = 0; i < 5; i++) after.push(await settled(execute(tx, sql`select pg_sleep(0.05)`)));
        }),
      );
      expect(first).toBeInstanceOf(LeaseLostError);
      expect(after).toEqual(Array.from({ length: 5 }, () => 'resolved'));
      expect((await execute(db, sql`select 1 as one`))[0]?.one).toBe(1);
      const next = await locks.acquire('L', { ttlMs: 60_000 });
      expect(
        await fencedTransaction(db, next, async (tx) => (await execute(tx, sql`select 2 as two`))[0]?.two),
      ).toEqual({
        status: 'applied',
        value: 2,
      });
      await next.release();
      await locks.close();
    });
  },
);

/**
 * node-postgres also takes a statement with a callback, or a Submittable (a cursor, a `Query`). A function that
 * sends those on its transaction's client (drizzle's `tx.session.client`) must get the same stop: answered with
 * the refusal in the form it asked in, and never a statement handed to a client while another waits in its queue.
 */
describe.runIf(needs('DATABASE_URL'))(
  'node-postgres: a lost lease and statements sent as callbacks or Submittables',
  () => {
    let close = async () => {};
    afterEach(async () => close());

    /** A pool on a fresh database that counts statements handed to a client while another waited in its queue. */
    async function spiedPool() {
      const t = await nodePostgresDatabase({ max: 1, migrated: true });
      const pool = new pg.Pool({ connectionString: t.url, max: 2 });
      pool.on('error', () => {});
      const queued = queuedPushes(pool);
      close = async () => {
        // Bounded: a connection a hung call still holds would keep the pool's end waiting.
        await Promise.race([pool.end(), sleep(5_000)]);
        await t.close();
      };
      const db = drizzleNodePostgres(pool) as unknown as Database;
      const openInTransaction = async () =>
        Number(
          (
            await execute(
              db,
              sql`select count(*)::int as n from pg_stat_activity
              where datname = current_database() and state like 'idle in transaction%'`,
            )
          )[0]?.n,
        );
      return { db, queued, openInTransaction };
    }

    // Bounded: a call that never settles (a statement the stop left unanswered) fails the test, not hangs it.
    const settledWithin = (call: Promise<unknown>) =>
      Promise.race([settled(call), sleep(10_000).then(() => 'still pending after 10 s')]);

    const clientOf = (tx: Database) => (tx as unknown as { session: { client: pg.ClientBase } }).session.client;
    const holder = (controller: AbortController) => ({ fence: toFence(1n), signal: controller.signal, lock: fakeLock });

    /** `text` as a bare Submittable; `answer` settles with 'ready' or the error the client handed it. */
    function submittable(text: string) {
      let finish!: (v: unknown) => void;
      const answer = new Promise<unknown>((resolve) => {
        finish = resolve;
      });
      const query = {
        submit: (connection: { query(text: string): void }) => connection.query(text),
        handleRowDescription() {},
        handleDataRow() {},
        handleCommandComplete() {},
        handleEmptyQuery() {},
        handleError: (err: unknown) => finish(err),
        handleReadyForQuery: () => finish('ready'),
      };
      return { query, answer };
    }

    // Each form sends `text` and settles with what the client answered it (an error, or 'ok'), never rejects.
    type Form = (client: pg.ClientBase, text: string) => Promise<unknown>;
    const viaCallback =
      (resolve: (v: unknown) => void) =>
      (err: Error | null | undefined): void =>
        resolve(err ?? 'ok');
    const forms: Record<string, Form> = {
      'a callback': (client, text) => new Promise((resolve) => client.query(text, viaCallback(resolve))),
      'a callback in the config': (client, text) =>
        new Promise((resolve) => client.query({ text, callback: viaCallback(resolve) } as unknown as string)),
      // What a helper `(text, values?, cb?) => client.query(text, values, cb)` sends when called as (text, cb).
      'a callback as the second of three arguments': (client, text) =>
        new Promise((resolve) => (client.query as (...a: unknown[]) => unknown)(text, viaCallback(resolve), undefined)),
      'a Submittable': (client, text) => {
        const s = submittable(text);
        client.query(s.query as unknown as pg.Submittable);
        return s.answer;
      },
      // pg calls the Query's own callback; the extra one is ignored.
      'a pg Query with its own callback': (client, text) =>
        new Promise((resolve) =>
          (client.query as (...a: unknown[]) => unknown)(new pg.Query(text, viaCallback(resolve)), () => {}),
        ),
    };
    for (const [form, send] of Object.entries(forms)) {
      it(`${form}, waiting behind a running statement when the lease is lost: the stop's rollback waits its turn`, async () => {
        const { db, queued, openInTransaction } = await spiedPool();
        const controller = new AbortController();
        const outcome = await settledWithin(
          fencedTransaction(db, holder(controller), async (tx) => {
            const client = clientOf(tx);
            const running = client.query('select pg_sleep(0.5)').catch(() => {});
            const waiting = send(client, 'select 1');
            controller.abort();
            await Promise.all([running, waiting]);
          }),
        );
        expect(outcome).toBeInstanceOf(LeaseLostError);
        expect(queued.n, 'statements handed to a client while another waited in its queue').toBe(0);
        expect(await openInTransaction()).toBe(0);
      });

      it(`${form}, sent after the loss: answered with LeaseLostError, the call settles, the connection goes back`, async () => {
        const { db, openInTransaction } = await spiedPool();
        const controller = new AbortController();
        let answer: unknown;
        const outcome = await settledWithin(
          fencedTransaction(db, holder(controller), async (tx) => {
            await execute(tx, sql`select 1`);
            controller.abort();
            answer = await send(clientOf(tx), 'select 2');
          }),
        );
        expect(answer).toBeInstanceOf(LeaseLostError);
        expect(outcome).toBeInstanceOf(LeaseLostError);
        expect(await openInTransaction()).toBe(0);
      });
    }

    it("without a loss every form passes through untouched: results, the callback's this, a frozen Submittable", async () => {
      const { db } = await spiedPool();
      const seen: unknown[] = [];
      const result = await fencedTransaction(db, holder(new AbortController()), async (tx) => {
        const client = clientOf(tx);
        for (const send of Object.values(forms)) seen.push(await send(client, 'select 1'));
        const self = await new Promise((resolve) =>
          client.query('select 1', function (this: unknown) {
            resolve(this instanceof pg.Query);
          }),
        );
        const frozen = submittable('select 1');
        client.query(Object.freeze(frozen.query) as unknown as pg.Submittable);
        return { self, frozen: await frozen.answer };
      });
      expect(seen).toEqual(['ok', 'ok', 'ok', 'ready', 'ok']);
      expect(result).toEqual({ status: 'applied', value: { self: true, frozen: 'ready' } });
    });

    it('after the loss a malformed call throws what node-postgres throws for it, queryable or not', async () => {
      const { db } = await spiedPool();
      const controller = new AbortController();
      const thrown: unknown[] = [];
      const outcome = await settledWithin(
        fencedTransaction(db, holder(controller), async (tx) => {
          await execute(tx, sql`select 1`);
          controller.abort();
          const query = clientOf(tx).query as (...a: unknown[]) => unknown;
          for (const args of [[null], [{ text: 'select 1', callback: 5 }], ['select 1', [], 5]]) {
            try {
              query(...args);
            } catch (err) {
              thrown.push((err as Error).message);
            }
          }
        }),
      );
      expect(outcome).toBeInstanceOf(LeaseLostError);
      expect(thrown).toEqual([
        'Client was passed a null or undefined query',
        'callback is not a function',
        'callback is not a function',
      ]);
    });

    it("with the pool's query_timeout and no connection free to cancel from: the rollback still goes out once the statement ends", async () => {
      const t = await nodePostgresDatabase({ max: 2, migrated: true });
      const pool = new pg.Pool({ connectionString: t.url, max: 1, query_timeout: 300 });
      pool.on('error', () => {});
      close = async () => {
        await Promise.race([pool.end(), sleep(5_000)]);
        await t.close();
      };
      const db = drizzleNodePostgres(pool) as unknown as Database;
      const controller = new AbortController();
      let inTransactionAfter = -1;
      const outcome = await settledWithin(
        fencedTransaction(db, holder(controller), async (tx) => {
          // Handed to the client before the abort (drizzle's execute would reach it only a few ticks later).
          const sleeping = clientOf(tx)
            .query('select pg_sleep(1)')
            .catch(() => {});
          controller.abort();
          await sleeping; // the client stopped waiting (query_timeout); the server still runs it
          // The function goes on; its transaction must not (looked at from another pool, bounded): once the
          // statement has ended, at most the empty transaction the rollback chained is left, until the driver's own.
          const count = async (where: ReturnType<typeof sql>) =>
            Number(
              (
                await execute(
                  t.db,
                  sql`select count(*)::int as n from pg_stat_activity where datname = current_database() and ${where}`,
                )
              )[0]?.n,
            );
          await until(async () => (await count(sql`query = 'select pg_sleep(1)' and state = 'active'`)) === 0);
          for (let i = 0; i < 150; i++) {
            inTransactionAfter = await count(sql`state like 'idle in transaction%' and query <> 'rollback and chain'`);
            if (inTransactionAfter === 0) break;
            await sleep(20);
          }
        }),
      );
      expect(outcome).toBeInstanceOf(LeaseLostError);
      expect(inTransactionAfter).toBe(0);
    });
  },
);
