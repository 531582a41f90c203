/**
 * A lease lost while the function of its fenced transaction (or of its
 * lock-scoped `modify`) runs (README, "Fenced transactions"), searched on a
 * REAL Postgres with both drivers. Each run draws:
 *
 * - one to three such calls under the same lease, at once, each on rows of
 *   its own (one lease signal stops them all), on a pool with a connection
 *   to spare;
 * - what each function does before the loss (lock-scoped writes, plain
 *   statements, `Promise.all` of writes, savepoints that commit or roll
 *   back, waits outside the database, a statement that fails on the
 *   server — awaited and caught, or on postgres.js not awaited at all and
 *   sent a few microtasks on, perhaps after the function returned) and after it (the same, plus a
 *   600 s statement — caught or not — and loops that go on sending
 *   statements and catch every error);
 * - when the loss comes (the lease released 0–20 ms after the first
 *   function reaches that point; the others may be anywhere then, or
 *   still waiting for a connection);
 * - the pool's size (2, 3 or 5 connections) and 0–3 other users of the same
 *   pool, each running plain queries and short transactions of its own
 *   throughout.
 *
 * The checks: each call either rejects with `LeaseLostError` and nothing
 * its function wrote is visible, or (the loss came after the function was
 * done) it applied and everything is — unless a statement of its function
 * failed on the server (its error caught): then it rejects whatever the
 * loss, and nothing is visible; the lock's next grant, waiting at most 5 s,
 * goes through while the function may still be going on; no query of the
 * other users failed and each of their transactions committed; once the
 * call settled, no connection of the pool is left in a transaction; the
 * server sent no warning (the driver's final rollback ends the transaction
 * the stop chained, quietly); and, on node-postgres, no statement was
 * handed to a client while another waited in its queue (deprecated by pg).
 */
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, LeaseLostError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import type { Lease } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { queuedPushes } from '../support/pg-queue.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });
// Rows 1…ROWS are the first call's, ROWS+1…2·ROWS the second's, and so on.
const ROWS = 4;
const MAX_CALLS = 3;

type Step =
  | { readonly t: 'write'; readonly row: number }
  | { readonly t: 'plain'; readonly row: number }
  | { readonly t: 'all'; readonly rows: readonly number[] }
  | { readonly t: 'savepoint'; readonly row: number; readonly rollback: boolean }
  | { readonly t: 'idle'; readonly ms: number }
  | { readonly t: 'fail' }
  | { readonly t: 'stray'; readonly ticks: number }
  | { readonly t: 'long'; readonly caught: boolean }
  | { readonly t: 'loop'; readonly n: number };
interface Call {
  readonly root: 'fenced' | 'modify';
  readonly before: readonly Step[];
  readonly after: readonly Step[];
}
interface Program {
  readonly calls: readonly Call[];
  readonly lossDelayMs: number;
  readonly pool: 2 | 3 | 5;
  readonly others: number;
}

// Rows 2… for the steps: a modify holds row 1 and writes it itself.
const row = fc.integer({ min: 2, max: ROWS });
const live: fc.Arbitrary<Step>[] = [
  fc.record({ t: fc.constant('write' as const), row }),
  // A statement that fails on the server, its error caught: the transaction is aborted, nothing it wrote is kept.
  fc.record({ t: fc.constant('fail' as const) }),
  // The same, not awaited: sent some microtasks on, maybe after the function returned (postgres.js; on
  // node-postgres, which deprecates a statement handed to a client while another runs, awaited as 'fail').
  fc.record({ t: fc.constant('stray' as const), ticks: fc.integer({ min: 0, max: 6 }) }),
  fc.record({ t: fc.constant('plain' as const), row }),
  fc.record({ t: fc.constant('all' as const), rows: fc.uniqueArray(row, { minLength: 2, maxLength: ROWS - 1 }) }),
  fc.record({ t: fc.constant('savepoint' as const), row, rollback: fc.boolean() }),
  fc.record({ t: fc.constant('idle' as const), ms: fc.integer({ min: 0, max: 30 }) }),
];
const callArb: fc.Arbitrary<Call> = fc.record({
  root: fc.constantFrom<Call['root']>('fenced', 'fenced', 'modify'),
  before: fc.array(fc.oneof(...live), { maxLength: 4 }),
  after: fc.array(
    fc.oneof(
      ...live,
      fc.record({ t: fc.constant('long' as const), caught: fc.boolean() }),
      fc.record({ t: fc.constant('loop' as const), n: fc.integer({ min: 1, max: 40 }) }),
    ),
    { maxLength: 4 },
  ),
});
const programArb: fc.Arbitrary<Program> = fc
  .record({
    // One call most often (its stop in every detail); several share one lease signal.
    calls: fc.oneof(
      { weight: 2, arbitrary: fc.array(callArb, { minLength: 1, maxLength: 1 }) },
      { weight: 1, arbitrary: fc.array(callArb, { minLength: 2, maxLength: MAX_CALLS }) },
    ),
    lossDelayMs: fc.integer({ min: 0, max: 20 }),
    pool: fc.constantFrom<Program['pool']>(2, 3, 5),
    others: fc.integer({ min: 0, max: 3 }),
  })
  // The cancel is sent from a free connection of the pool (README: with every connection in a
  // transaction it waits, and a long statement runs to its end).
  .filter((p) => p.pool > p.calls.length);

// A call whose lease is lost while its one statement runs.
const lostInStatement: Call = { root: 'fenced', before: [], after: [{ t: 'long', caught: false }] };

class RollBack extends Error {}

/**
 * A pool of the test's database, with every notice the server sent on it and — node-postgres — how many
 * statements were handed to a client while another waited in its queue (what pg 8.x deprecates).
 */
interface Pool {
  readonly db: Database;
  readonly notices: string[];
  readonly queued: { n: number };
  end(): Promise<void>;
}

const pools = {
  'postgres.js'(url: string, max: number): Pool {
    const notices: string[] = [];
    const client = postgres(url, { max, onnotice: (n) => notices.push(`${n.severity} ${n.code} ${n.message}`) });
    return {
      db: drizzlePostgres(client) as unknown as Database,
      notices,
      queued: { n: 0 },
      end: () => client.end({ timeout: 1 }),
    };
  },
  'node-postgres'(url: string, max: number): Pool {
    const notices: string[] = [];
    const pool = new pg.Pool({ connectionString: url, max });
    pool.on('error', () => {});
    const queued = queuedPushes(pool);
    pool.on('connect', (client) => {
      client.on('notice', (n) => notices.push(`${n.severity} ${n.code} ${n.message}`));
    });
    return { db: drizzleNodePostgres(pool) as unknown as Database, notices, queued, end: () => pool.end() };
  },
};

for (const driver of ['postgres.js', 'node-postgres'] as const) {
  describe.runIf(needs('DATABASE_URL'))(`${driver}: a lease lost while its transaction's function runs`, () => {
    let base: TestDatabase | undefined;
    let url = '';
    const bySize = new Map<number, Pool>();
    let lockPool: Pool;
    let locks: LockManager;
    let run = 0;
    const reached = { lost: 0, duringStatement: 0, applied: 0, lostOfSeveral: 0, aborted: 0 };

    beforeAll(async () => {
      base = await postgresDatabase({ max: 2 });
      url = base.url as string;
      await migrate(base.db);
      await execute(
        base.db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(
        base.db,
        sql`insert into resource (id, value) select g, 'initial' from generate_series(1, ${ROWS * MAX_CALLS}) g`,
      );
      await execute(base.db, sql`create table bystander (id int primary key, n int not null)`);
      await execute(base.db, sql`insert into bystander select g, 0 from generate_series(1, 3) g`);
      // The lock manager on a pool of its own: the next grant must not wait for the app's connections.
      lockPool = pools[driver](url, 4);
      locks = postgresLockManager({ client: lockPool.db, namespace: 'lostprop' });
    }, 120_000);
    afterAll(async () => {
      await locks?.close();
      await lockPool?.end();
      for (const p of bySize.values()) await p.end();
      await base?.close();
    });

    // Two programs run first, whatever the count: at a quarter of it the random ones once never lost a lease
    // shared by several calls.
    const examples: [Program][] = [
      [{ calls: [lostInStatement, lostInStatement], lossDelayMs: 0, pool: 5, others: 1 }],
      [{ calls: [{ root: 'fenced', before: [{ t: 'fail' }], after: [] }], lossDelayMs: 0, pool: 2, others: 0 }],
    ];
    test.prop([programArb], { ...propertyParams({ numRuns: propertyRuns(200) }), examples })(
      'each call: LeaseLostError and nothing visible (or applied, all visible; never applied after a failed statement); the next grant goes through; no other query fails; no connection left in a transaction; no warning',
      async (program) => {
        run++;
        let pool = bySize.get(program.pool);
        if (!pool) {
          pool = pools[driver](url, program.pool);
          bySize.set(program.pool, pool);
        }
        const { db, notices, queued } = pool;
        notices.length = 0;
        queued.n = 0;
        await execute(db, sql`update resource set value = 'initial', last_fence = 0`);
        // Several writes of one fence to one row, as a function's steps may make.
        const repo = fencedRepository(db, resource, { sameFence: 'allow' });
        const name = `L${run}`;
        const lease: Lease = await locks.acquire(name, { ttlMs: 60_000 });

        // What a commit would show: the model of each function's writes, in order (its own rows).
        const expected = program.calls.map(
          (_, c) => new Map<number, string>(Array.from({ length: ROWS }, (_, i) => [c * ROWS + i + 1, 'initial'])),
        );
        let lost = false;
        const failed = program.calls.map(() => false);
        const settledCalls = program.calls.map(() => false);
        let wrote = 0;
        const value = () => `w${++wrote}`;
        const exec = async (tx: Database, steps: readonly Step[], c: number) => {
          const at = (r: number) => c * ROWS + r;
          const model = expected[c] as Map<number, string>;
          for (const s of steps) {
            if (s.t === 'write') {
              const v = value();
              const r = await repo.with(lease).update({ id: at(s.row) }, { value: v });
              expect(r.status).toBe('applied');
              model.set(at(s.row), v);
            } else if (s.t === 'plain') {
              const v = value();
              await execute(tx, sql`update resource set value = ${v} where id = ${at(s.row)}`);
              model.set(at(s.row), v);
            } else if (s.t === 'all') {
              const vs = s.rows.map(() => value());
              const write = (r: number, i: number) => repo.with(lease).update({ id: at(r) }, { value: vs[i] });
              // node-postgres deprecates queries sent to one client while another waits: there they go in turn.
              const rs =
                driver === 'postgres.js'
                  ? await Promise.all(s.rows.map(write))
                  : await s.rows.reduce(
                      async (done, r, i) => [...(await done), await write(r, i)],
                      Promise.resolve([] as Awaited<ReturnType<typeof write>>[]),
                    );
              for (const r of rs) expect(r.status).toBe('applied');
              for (const [i, r] of s.rows.entries()) model.set(at(r), vs[i] as string);
            } else if (s.t === 'savepoint') {
              const v = value();
              const done = await tx
                .transaction(async (sp) => {
                  await execute(
                    sp as unknown as Database,
                    sql`update resource set value = ${v} where id = ${at(s.row)}`,
                  );
                  if (s.rollback) throw new RollBack();
                })
                .then(
                  () => true,
                  (err: unknown) => {
                    if (!(err instanceof RollBack) && !lost) throw err;
                    return false;
                  },
                );
              if (done) model.set(at(s.row), v);
            } else if (s.t === 'stray' && driver === 'postgres.js') {
              void (async () => {
                for (let i = 0; i < s.ticks; i++) await null;
                await execute(tx, sql`select 1 / 0`);
              })().catch((e: unknown) => {
                // Failed on the server inside the transaction (not refused: after the loss, or sent once
                // the function had returned).
                if (e instanceof DatabaseError && !settledCalls[c]) failed[c] = true;
              });
            } else if (s.t === 'fail' || s.t === 'stray') {
              const err = await execute(tx, sql`select 1 / 0`).then(
                () => undefined,
                (e: unknown) => e,
              );
              // Failed on the server (not refused before it was sent, once the lease was lost).
              if (err instanceof DatabaseError) failed[c] = true;
            } else if (s.t === 'idle') {
              await sleep(s.ms);
            } else if (s.t === 'long') {
              const slept = execute(tx, sql`select pg_sleep(600)`);
              await (s.caught ? slept.catch(() => {}) : slept);
            } else {
              for (let i = 0; i < s.n; i++) {
                await execute(tx, sql`select ${i}::int as i`).catch(() => {});
                await sleep(1);
              }
            }
          }
        };
        // The loss comes once, after the first function to get there is done with its first steps.
        let lossSet = false;
        const fn = (c: number) => async (tx: Database) => {
          const call = program.calls[c] as Call;
          await exec(tx, call.before, c);
          if (!lossSet) {
            lossSet = true;
            setTimeout(() => {
              lost = true;
              void lease.release();
            }, program.lossDelayMs);
          }
          await exec(tx, call.after, c);
        };

        // The other users of the pool: plain queries and short transactions, until the run is over.
        const [before] = await execute(db, sql`select coalesce(sum(n), 0)::int as n from bystander`);
        let over = false;
        let committed = 0;
        const othersFailed: unknown[] = [];
        const others = Array.from({ length: program.others }, async (_, w) => {
          for (let i = 0; i < 2_000 && !over; i++) {
            try {
              if (i % 2 === 0) {
                const [r] = await execute(db, sql`select ${w}::int as w`);
                if (r?.w !== w) throw new Error(`select ${w} answered ${String(r?.w)}`);
              } else {
                await db.transaction(async (tx) => {
                  await tx.execute(sql`update bystander set n = n + 1 where id = ${w + 1}`);
                });
                committed++;
              }
            } catch (err) {
              othersFailed.push(err);
              return;
            }
            await sleep(2);
          }
        });

        // Every call settles: one that hangs fails the run (its program is the counterexample).
        let hung: NodeJS.Timeout | undefined;
        const settled = Promise.all(
          program.calls.map((call, c) =>
            (call.root === 'fenced'
              ? fencedTransaction(db, lease, fn(c))
              : repo.with(lease).modify({ id: c * ROWS + 1 }, async (_row, tx) => {
                  await fn(c)(tx);
                  const v = value();
                  expected[c]?.set(c * ROWS + 1, v);
                  return { value: v };
                })
            ).then(
              (r) => {
                settledCalls[c] = true;
                return r;
              },
              (err: unknown) => {
                settledCalls[c] = true;
                return err;
              },
            ),
          ),
        );
        const outcomes = await Promise.race([
          settled,
          new Promise<never>((_, reject) => {
            hung = setTimeout(() => reject(new Error('a call did not settle within 20 s of its lease loss')), 20_000);
          }),
        ]).finally(() => clearTimeout(hung));
        // Every call ended before one got to the loss (its function threw): the lease is let go here.
        if (!lossSet) await lease.release();
        // The next holder: its grant claims the register, and finds it locked while the stopped transaction holds it.
        const next = await locks.acquire(name, { ttlMs: 60_000, waitMs: 5_000 }).catch((err: unknown) => err);
        over = true;
        await Promise.all(others);
        expect(othersFailed).toEqual([]);

        const seen = await execute(db, sql`select id, value from resource order by id`);
        const visible = new Map(seen.map((r) => [Number(r.id), String(r.value)]));
        for (const [c, outcome] of outcomes.entries()) {
          const rows = [...(expected[c] as Map<number, string>).keys()];
          const mine = new Map(rows.map((id) => [id, visible.get(id)]));
          if (failed[c]) {
            // Never applied: the COMMIT of an aborted transaction is a rollback, whatever the driver says.
            // (What the function itself throws after the failure reaches the caller as it was thrown.)
            expect(outcome, `call ${c}`).toBeInstanceOf(Error);
            expect([...mine.values()], `call ${c}`).toEqual(rows.map(() => 'initial'));
            reached.aborted++;
          } else if (outcome instanceof Error) {
            expect(outcome, `call ${c}`).toBeInstanceOf(LeaseLostError);
            reached.lost++;
            if (program.calls[c]?.after.some((s) => s.t === 'long')) reached.duringStatement++;
            if (program.calls.length > 1) reached.lostOfSeveral++;
            expect([...mine.values()], `call ${c}`).toEqual(rows.map(() => 'initial'));
          } else {
            expect(outcome, `call ${c}`).toMatchObject({ status: 'applied' });
            expect(mine, `call ${c}`).toEqual(expected[c]);
            reached.applied++;
          }
        }
        expect(next).toHaveProperty('fence');
        await (next as Lease).release();
        const [after] = await execute(db, sql`select coalesce(sum(n), 0)::int as n from bystander`);
        expect(Number(after?.n) - Number(before?.n)).toBe(committed);
        // The stop's last look may still be on its way once the call settled: bounded.
        let open = -1;
        for (let i = 0; i < 250 && open !== 0; i++) {
          if (i > 0) await sleep(20);
          const [r] = await execute(
            db,
            sql`select count(*)::int as n from pg_stat_activity
              where datname = current_database() and pid <> pg_backend_pid() and state <> 'idle'`,
          );
          open = Number(r?.n);
        }
        expect(open).toBe(0);
        expect(notices).toEqual([]);
        expect(queued.n, 'statements handed to a node-postgres client while another waited in its queue').toBe(0);
      },
      propertyTimeout(600_000),
    );

    it('the runs reached the stop: lost leases, some in the middle of a statement, some under one lease with other calls, and calls done before the loss', () => {
      expect(reached.lost).toBeGreaterThan(0);
      expect(reached.lostOfSeveral).toBeGreaterThan(0);
      expect(reached.duringStatement).toBeGreaterThan(0);
      expect(reached.applied).toBeGreaterThan(0);
      expect(reached.aborted).toBeGreaterThan(0);
    });
  });
}
