/**
 * Calls that overlap on one transaction (README, "Fenced transactions"),
 * searched on PGlite, postgres.js and a node-postgres pool: each run starts
 * a few calls at once on one transaction — your own (`db.transaction`) or a
 * fenced transaction — each a few microtasks after the last, each writing a
 * row of its own: row-scoped updates, lock-scoped updates, `modify`s whose
 * function returns a patch or throws. A transaction is one session, so a
 * statement of one call sent while another call's savepoint is open runs
 * inside that savepoint, and a rollback to it would undo the statement after
 * its call reported `applied`. The promise checked, after the transaction
 * commits: every call that reported `applied` has its row written, and
 * every other call left its row as it was. palisade refuses a call that
 * would run inside another's savepoint with `InvalidArgumentError`, before
 * it sends anything.
 */
import type { EventEmitter } from 'node:events';
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { InvalidArgumentError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { everyTransactionDriver, type TestDatabase } from '../support/databases.js';
import { eventually } from '../support/lock-workers.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });
const CALLS = 5;
const fence = toFence(5n) as Fence;

type Kind =
  | 'update'
  | 'lock-scoped update'
  | 'modify'
  | 'modify that throws'
  | 'lock-scoped modify'
  | 'lock-scoped modify that throws'
  | 'nested fenced transaction'
  | 'nested fenced transaction that throws';
interface Call {
  readonly kind: Kind;
  /** Microtasks between the previous call's start and this one's. */
  readonly ticks: number;
  /**
   * For a modify: its function starts a call on another row `ticks` microtasks on and does not await it (it
   * may run inside the savepoint, or after the modify ended): an update, or a modify whose own function
   * takes `ms` (a savepoint that may outlive the one it was opened in) — through the other name of the
   * session when `other` (a fenced transaction's `tx` where the calls go through its database); `null`:
   * it starts none.
   */
  readonly leak: Leak | null;
}
interface Leak {
  readonly kind: 'update' | 'modify' | 'modify that throws';
  readonly ticks: number;
  readonly ms: number;
  readonly other: boolean;
  /** ms more before it starts: long after the modify ended, when not 0. */
  readonly late: number;
}
const callArb: fc.Arbitrary<Call> = fc.record({
  kind: fc.constantFrom<Kind>(
    'update',
    'lock-scoped update',
    'modify',
    'modify that throws',
    'lock-scoped modify',
    'lock-scoped modify that throws',
    'nested fenced transaction',
    'nested fenced transaction that throws',
  ),
  ticks: fc.integer({ min: 0, max: 4 }),
  leak: fc.option(
    fc.record({
      kind: fc.constantFrom<Leak['kind']>('update', 'modify', 'modify that throws'),
      ticks: fc.integer({ min: 0, max: 8 }),
      ms: fc.constantFrom(0, 5, 20),
      other: fc.boolean(),
      late: fc.constantFrom(0, 0, 30),
    }),
  ),
});

/** A call's outcome, the row it writes, and the modify whose function started it (if one did). */
interface Started {
  readonly row: number;
  readonly what: string;
  readonly outcome: Promise<unknown>;
  readonly inside?: number;
}

class Thrown extends Error {}

// Not a single node-postgres Client: its transactions run on the database's own session, so a call made
// on the database outside the transaction would be one more overlapping call.
const drivers = everyTransactionDriver.filter((d) => d.name !== 'a single node-postgres Client');

for (const { name, open, real } of drivers) {
  describe.runIf(!real || needs('DATABASE_URL'))(`${name}: calls that overlap on one transaction`, () => {
    let t: TestDatabase | undefined;
    let run = 0;
    beforeAll(async () => {
      t = await open({ migrated: true });
      await execute(
        t.db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(
        t.db,
        sql`insert into resource (id, value) select g, 'initial' from generate_series(1, ${2 * CALLS}) g`,
      );
    }, 120_000);
    afterAll(async () => {
      await t?.close();
    });

    /** A holder of a lock of its own (claimed lazily, as a Redis lock's is) at `fence`. */
    const holder = () => ({
      fence,
      signal: new AbortController().signal,
      lock: Object.freeze({ kind: 'redis', source: 'overlap-test', namespace: 'test', name: `L${++run}` }),
    });

    /**
     * Starts `calls` on `on` (call i on row i + 1; an update its function leaves running on row
     * CALLS + i + 1), a few microtasks apart; each call, once all settled.
     */
    async function overlap(on: Database, other: Database, calls: readonly Call[], lease: ReturnType<typeof holder>) {
      const repo = fencedRepository(on, resource, { sameFence: 'allow' });
      const otherRepo = fencedRepository(other, resource, { sameFence: 'allow' });
      const started: Started[] = [];
      for (const [i, call] of calls.entries()) {
        for (let k = 0; k < call.ticks; k++) await null;
        const row = i + 1;
        const value = `call ${row}`;
        if (call.kind === 'update')
          started.push({ row, what: call.kind, outcome: repo.update({ id: row }, fence, { value }) });
        else if (call.kind === 'lock-scoped update')
          started.push({ row, what: call.kind, outcome: repo.with(lease).update({ id: row }, { value }) });
        else if (call.kind === 'nested fenced transaction' || call.kind === 'nested fenced transaction that throws') {
          // Opened on `on` (a savepoint of it), its write through the same repository, which joins it.
          const outcome = fencedTransaction(on, holder(), async () => {
            const written = await repo.update({ id: row }, fence, { value });
            if (call.kind === 'nested fenced transaction that throws') throw new Thrown('the function threw');
            return written;
          });
          started.push({ row, what: call.kind, outcome });
        } else {
          // A lock-scoped modify opens its savepoint inside its claim's.
          const lockScoped = call.kind === 'lock-scoped modify' || call.kind === 'lock-scoped modify that throws';
          const modify = (fn: () => Promise<{ value: string }>) =>
            lockScoped ? repo.with(lease).modify({ id: row }, fn) : repo.modify({ id: row }, fence, fn);
          const outcome = modify(async () => {
            const { leak } = call;
            if (leak !== null) {
              const id = CALLS + row;
              const through = leak.other ? otherRepo : repo;
              const left = (async () => {
                for (let k = 0; k < leak.ticks; k++) await null;
                if (leak.late > 0) await sleep(leak.late);
                if (leak.kind === 'update') return through.update({ id }, fence, { value: `call ${id}` });
                return through.modify({ id }, fence, async () => {
                  await sleep(leak.ms);
                  if (leak.kind === 'modify that throws') throw new Thrown('the function threw');
                  return { value: `call ${id}` };
                });
              })();
              left.catch(() => {}); // read once every call settled
              started.push({ row: id, what: `a ${leak.kind} a modify left running`, outcome: left, inside: row });
            }
            await null;
            if (call.kind.endsWith('that throws')) throw new Thrown('the function threw');
            return { value };
          });
          started.push({ row, what: call.kind, outcome });
        }
      }
      // Once the calls settled, every update a function left running has been started too.
      await Promise.allSettled(started.map((c) => c.outcome));
      const settled = await Promise.allSettled(started.map((c) => c.outcome));
      return started.map((c, i) => ({ ...c, settled: settled[i] as PromiseSettledResult<unknown> }));
    }

    const appliedIn = (r: PromiseSettledResult<unknown>) =>
      r.status === 'fulfilled' && (r.value as { status?: unknown }).status === 'applied';

    // What a call inside a modify's function writes is part of that modify: it stays only if the modify applied.
    async function check(started: Awaited<ReturnType<typeof overlap>>, committed: boolean) {
      const rows = await execute((t as TestDatabase).db, sql`select id, value from resource order by id`);
      const visible = new Map(rows.map((r) => [Number(r.id), String(r.value)]));
      const byRow = new Map(started.map((c) => [c.row, c]));
      for (const c of started) {
        const applied = appliedIn(c.settled);
        const parent = c.inside === undefined ? true : appliedIn((byRow.get(c.inside) as typeof c).settled);
        const expected = applied && parent && committed ? `call ${c.row}` : 'initial';
        if (visible.get(c.row) !== expected) {
          throw new Error(
            `${c.what} on row ${c.row}: reported ${applied ? 'applied' : 'not applied'}, row holds ${visible.get(c.row)}`,
          );
        }
        if (c.settled.status === 'rejected') {
          const err = c.settled.reason as unknown;
          if (!(err instanceof InvalidArgumentError || err instanceof Thrown)) throw err;
        }
      }
    }

    const reset = () =>
      execute((t as TestDatabase).db, sql`update resource set value = 'initial', last_fence = 0, deleted_at = null`);

    // Where the calls overlap: `run` starts them on the transaction; each says whether the transaction committed.
    // `run(on, other)`: the calls go through `on`; `other` is the other name of the session, if it has one.
    const contexts: [
      string,
      (db: Database, run: (on: Database, other: Database) => Promise<void>) => Promise<boolean>,
    ][] = [
      [
        "in the caller's own transaction",
        async (db, run) => {
          await db.transaction((tx) => run(tx as unknown as Database, tx as unknown as Database));
          return true;
        },
      ],
      // The repository is on `db`: inside the fenced transaction its calls join it.
      [
        'in a fenced transaction',
        async (db, run) => (await fencedTransaction(db, holder(), (ftx) => run(db, ftx))).status === 'applied',
      ],
    ];
    for (const [where, inContext] of contexts) {
      test.prop(
        [fc.array(callArb, { minLength: 2, maxLength: CALLS })],
        propertyParams({ numRuns: propertyRuns(100) }),
      )(
        `${where}: applied means written, anything else left the row as it was`,
        async (calls) => {
          await reset();
          let started: Awaited<ReturnType<typeof overlap>> = [];
          const lease = holder();
          const committed = await inContext((t as TestDatabase).db, async (on, other) => {
            started = await overlap(on, other, calls, lease);
          });
          await check(started, committed);
        },
        propertyTimeout(200_000),
      );
    }

    it('a modify whose function throws beside an update: the update is refused, not reported applied and undone', async () => {
      await reset();
      const db = (t as TestDatabase).db;
      const calls = await db.transaction(async (tx) =>
        overlap(
          tx as unknown as Database,
          tx as unknown as Database,
          [
            { kind: 'modify that throws', ticks: 0, leak: null },
            { kind: 'update', ticks: 0, leak: null },
          ],
          holder(),
        ),
      );
      expect(calls.map((c) => c.settled)).toMatchObject([
        { status: 'rejected', reason: expect.any(Thrown) },
        { status: 'rejected', reason: expect.any(InvalidArgumentError) },
      ]);
      const rows = await execute(db, sql`select value from resource where id in (1, 2) order by id`);
      expect(rows.map((r) => r.value)).toEqual(['initial', 'initial']);
    });

    it('an update a modify left running, once the modify ended, is refused rather than run inside the next savepoint', async () => {
      await reset();
      const db = (t as TestDatabase).db;
      const outcomes = await db.transaction(async (tx) => {
        const repo = fencedRepository(tx as unknown as Database, resource, { sameFence: 'allow' });
        let left: Promise<unknown> = Promise.resolve();
        let go = () => {};
        const gate = new Promise<void>((resolve) => {
          go = resolve;
        });
        const first = await repo.modify({ id: 1 }, fence, async () => {
          left = gate.then(() => repo.update({ id: 2 }, fence, { value: 'left running' }));
          return { value: 'first' };
        });
        const second = repo.modify({ id: 3 }, fence, async () => {
          go();
          await sleep(50);
          throw new Thrown('the function threw');
        });
        return [first, ...(await Promise.allSettled([left, second]))];
      });
      expect(outcomes).toMatchObject([
        { status: 'applied' },
        { status: 'rejected', reason: expect.any(InvalidArgumentError) },
        { status: 'rejected', reason: expect.any(Thrown) },
      ]);
      const rows = await execute(db, sql`select value from resource where id <= 3 order by id`);
      expect(rows.map((r) => r.value)).toEqual(['first', 'initial', 'initial']);
    });

    it("a modify left running past a fenced transaction's function: the transaction is refused and nothing either wrote is visible", async () => {
      await reset();
      const db = (t as TestDatabase).db;
      let left: Promise<unknown> = Promise.resolve();
      const outcome = await fencedTransaction(db, holder(), async () => {
        const repo = fencedRepository(db, resource, { sameFence: 'allow' });
        await repo.update({ id: 3 }, fence, { value: 'in the transaction' });
        left = repo.modify({ id: 1 }, fence, async () => {
          await sleep(50);
          await repo.update({ id: 2 }, fence, { value: 'inside the modify' });
          return { value: 'the modify' };
        });
        left.catch(() => {}); // read below
        await sleep(10); // its savepoint is open; return without it
      }).catch((err: unknown) => err);
      expect(outcome).toBeInstanceOf(InvalidArgumentError);
      const [modify] = await Promise.allSettled([left]);
      expect(modify?.status).toBe('rejected');
      await sleep(50);
      const rows = await execute(db, sql`select value from resource where id <= 3 order by id`);
      expect(rows.map((r) => r.value)).toEqual(['initial', 'initial', 'initial']);
    });

    // The modify left running was refused with its parent, whose rollback took its savepoint; its own
    // RELEASE or ROLLBACK TO, sent once its function settled, failed (3B001) and aborted the transaction
    // that went on past the refused call: postgres.js committed nothing and reported `applied`.
    for (const inner of ['returns', 'throws'] as const) {
      it(`a modify left running inside a modify, whose function ${inner} after that ended, sends nothing: the transaction that goes on commits`, async () => {
        await reset();
        const db = (t as TestDatabase).db;
        let left: Promise<unknown> = Promise.resolve();
        const result = await fencedTransaction(db, holder(), async () => {
          const repo = fencedRepository(db, resource, { sameFence: 'allow' });
          const before = await repo.update({ id: 1 }, fence, { value: 'before' });
          const outer = await repo
            .modify({ id: 2 }, fence, async () => {
              // The outer function returns once the inner one runs (a fixed sleep lost that race under load:
              // the inner modify, not yet past its read, was refused before its function could throw).
              let runs = false;
              left = repo.modify({ id: 3 }, fence, async () => {
                runs = true;
                await sleep(50);
                if (inner === 'throws') throw new Thrown('the function threw');
                return { value: 'left running' };
              });
              left.catch(() => {}); // read below
              expect(await eventually(async () => runs, 400, 25), 'the inner modify never ran its function').toBe(true);
              return { value: 'outer' };
            })
            .catch((err: unknown) => err);
          const [settled] = await Promise.allSettled([left]);
          const after = await repo.update({ id: 4 }, fence, { value: 'after' });
          return [before.status, outer, settled, after.status];
        });
        expect(result).toMatchObject({
          status: 'applied',
          value: [
            'applied',
            expect.any(InvalidArgumentError),
            { status: 'rejected', reason: inner === 'throws' ? expect.any(Thrown) : expect.any(InvalidArgumentError) },
            'applied',
          ],
        });
        const rows = await execute(db, sql`select value from resource where id <= 4 order by id`);
        expect(rows.map((r) => r.value)).toEqual(['before', 'initial', 'initial', 'after']);
      });
    }

    /** A database of its own on a pool of one connection (none of palisade's statements prepared on it yet), rows 1…3. */
    async function poolOfOne(): Promise<TestDatabase> {
      const one = await open({ migrated: true, max: 1 });
      await execute(
        one.db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(one.db, sql`insert into resource (id, value) select g, 'initial' from generate_series(1, 3) g`);
      return one;
    }

    // postgres.js describes a statement new on its connection before it binds it, and meanwhile queues the
    // transaction's later statements, the driver's ROLLBACK among them. A modify's locking read, sent after
    // that ROLLBACK, waited behind it forever: its promise never settled.
    it('a fenced transaction that returns with an update and a modify left running: every call settles, nothing is written', async () => {
      const one = await poolOfOne();
      try {
        const repo = fencedRepository(one.db, resource, { sameFence: 'allow' });
        let left: Promise<unknown>[] = [];
        let started = () => {};
        const inside = new Promise<void>((resolve) => {
          started = resolve;
        });
        const outcome = fencedTransaction(one.db, holder(), async () => {
          left = [
            repo.update({ id: 2 }, fence, { value: 'left running' }),
            repo.modify({ id: 1 }, fence, async () => ({ value: 'left running' })),
          ];
          started();
        });
        await Promise.race([inside, outcome.catch(() => {})]);
        const all = Promise.allSettled([outcome, ...left]);
        const settled = await Promise.race([all, sleep(10_000).then(() => 'still running after 10 s')]);
        expect(settled).toMatchObject([
          { status: 'rejected', reason: expect.any(InvalidArgumentError) },
          {}, // ran inside the transaction (applied there, rolled back with it), or refused
          { status: 'rejected', reason: expect.any(InvalidArgumentError) },
        ]);
        const rows = await execute(one.db, sql`select value from resource order by id`);
        expect(rows.map((r) => r.value)).toEqual(['initial', 'initial', 'initial']);
      } finally {
        await one.close();
      }
    });

    // palisade listens to a pool client's errors while its savepoint runs in your transaction, until the
    // driver finishes the savepoint; the driver never finishes one left running past its parent.
    it.runIf(name === 'node-postgres')(
      'modifies left running past a modify in your own transaction leave no listener on the pooled client',
      async () => {
        const one = await poolOfOne();
        try {
          const repo = fencedRepository(one.db, resource, { sameFence: 'allow' });
          const client = () => (one.db as unknown as { $client: { _clients: EventEmitter[] } }).$client._clients[0];
          const listening: number[] = [];
          for (let i = 0; i < 12; i++) {
            let inner: Promise<unknown> = Promise.resolve();
            await one.db.transaction(async (tx) => {
              const outer = await fencedRepository(tx as unknown as Database, resource, { sameFence: 'allow' })
                .modify({ id: 1 }, fence, async (_row, mtx) => {
                  inner = fencedRepository(mtx, resource, { sameFence: 'allow' }).modify({ id: 2 }, fence, async () => {
                    await sleep(30);
                    return { value: 'left running' };
                  });
                  inner.catch(() => {}); // read below
                  await sleep(5);
                  return { value: 'outer' };
                })
                .catch((err: unknown) => err);
              expect(outer).toBeInstanceOf(InvalidArgumentError);
            });
            await expect(inner).rejects.toBeInstanceOf(InvalidArgumentError);
            listening.push(client()?.listenerCount('error') ?? -1);
          }
          expect(new Set(listening).size).toBe(1);
          expect((await repo.update({ id: 3 }, fence, { value: 'after' })).status).toBe('applied');
        } finally {
          await one.close();
        }
      },
    );

    // On a pool of one the next transaction runs on the connection of the last. The left call's savepoint
    // went with the first transaction's rollback; its own ROLLBACK TO, sent when its function returned, hit
    // the next transaction's savepoint of the same name and undid a write reported applied there.
    it('a modify left running past a fenced transaction that threw sends nothing into the next transaction on its connection', async () => {
      const one = await poolOfOne();
      try {
        const repo = fencedRepository(one.db, resource, { sameFence: 'allow' });
        let left: Promise<unknown> = Promise.resolve();
        const first = await fencedTransaction(one.db, holder(), async () => {
          left = repo.modify({ id: 1 }, fence, async () => {
            await sleep(60);
            return { value: 'left running' };
          });
          left.catch(() => {}); // read below
          await sleep(10);
          throw new Thrown('the function threw');
        }).catch((err: unknown) => err);
        const second = await fencedTransaction(one.db, holder(), async () => {
          const inside = await repo.modify({ id: 2 }, fence, async () => {
            await repo.update({ id: 3 }, fence, { value: 'inside' });
            await sleep(100); // the modify left running returns meanwhile
            return { value: 'second' };
          });
          return inside.status;
        });
        expect(first).toBeInstanceOf(Thrown);
        expect(second).toEqual({ status: 'applied', value: 'applied' });
        expect((await Promise.allSettled([left]))[0]?.status).toBe('rejected');
        const rows = await execute(one.db, sql`select value from resource order by id`);
        expect(rows.map((r) => r.value)).toEqual(['initial', 'second', 'inside']);
      } finally {
        await one.close();
      }
    });

    it('inside a fenced transaction, calls through the database and through its transaction join a savepoint alike', async () => {
      await reset();
      const db = (t as TestDatabase).db;
      const lease = holder();
      const onDb = fencedRepository(db, resource, { sameFence: 'allow' });
      const result = await fencedTransaction(db, lease, async (ftx) => {
        const onTx = fencedRepository(ftx, resource, { sameFence: 'allow' });
        const statuses: unknown[] = [];
        // A modify through one name, a write through the other inside its function; both orders.
        statuses.push(
          (
            await onDb.modify({ id: 1 }, fence, async () => {
              statuses.push((await onTx.update({ id: 2 }, fence, { value: 'b' })).status);
              statuses.push(await claimLockRegister(ftx, holder()));
              return { value: 'a' };
            })
          ).status,
        );
        statuses.push(
          (
            await onTx.modify({ id: 3 }, fence, async () => {
              statuses.push((await onDb.update({ id: 4 }, fence, { value: 'd' })).status);
              return { value: 'c' };
            })
          ).status,
        );
        // A nested fenced transaction opened through either name, written through the other.
        const nested = await fencedTransaction(ftx, holder(), async () =>
          onDb.update({ id: 5 }, fence, { value: 'e' }),
        );
        statuses.push(nested.status);
        // A lock-scoped modify, whose savepoint opens inside its claim's: the other name joins it too.
        statuses.push(
          (
            await onTx.with(lease).modify({ id: 6 }, async () => {
              statuses.push((await onDb.update({ id: 7 }, fence, { value: 'g' })).status);
              return { value: 'f' };
            })
          ).status,
        );
        return statuses;
      });
      expect(result).toEqual({
        status: 'applied',
        value: ['applied', { status: 'claimed' }, 'applied', 'applied', 'applied', 'applied', 'applied', 'applied'],
      });
      const rows = await execute(db, sql`select value from resource where id <= 7 order by id`);
      expect(rows.map((r) => r.value)).toEqual(['a', 'b', 'c', 'd', 'e', 'f', 'g']);
    });

    // The first of them claims the lock in its own statement (the lease's first lock-scoped write): no savepoint.
    it("lock-scoped updates and a delete that apply overlap in the caller's transaction, none refused", async () => {
      await reset();
      const db = (t as TestDatabase).db;
      const lease = holder();
      const statuses = await db.transaction(async (tx) => {
        const repo = fencedRepository(tx as unknown as Database, resource, { sameFence: 'allow' }).with(lease);
        const all = await Promise.all([
          ...[1, 2, 3].map((id) => repo.update({ id }, { value: `lock ${id}` })),
          repo.delete({ id: 4 }),
        ]);
        return all.map((r) => r.status);
      });
      expect(statuses).toEqual(['applied', 'applied', 'applied', 'applied']);
      const rows = await execute(
        db,
        sql`select value, deleted_at is not null as deleted from resource where id <= 4 order by id`,
      );
      expect(rows.map((r) => [r.value, r.deleted])).toEqual([
        ['lock 1', false],
        ['lock 2', false],
        ['lock 3', false],
        ['initial', true],
      ]);
    });

    it("a get overlapping a modify's savepoint is a read and passes; an update beside it is refused", async () => {
      await reset();
      const db = (t as TestDatabase).db;
      const outcomes = await db.transaction(async (tx) => {
        const repo = fencedRepository(tx as unknown as Database, resource, { sameFence: 'allow' });
        let opened = () => {};
        const inside = new Promise<void>((resolve) => {
          opened = resolve;
        });
        const modify = repo.modify({ id: 1 }, fence, async () => {
          opened();
          await sleep(30);
          return { value: 'modified' };
        });
        await inside; // the modify's savepoint is open
        return Promise.allSettled([repo.get({ id: 2 }), repo.update({ id: 3 }, fence, { value: 'beside' }), modify]);
      });
      expect(outcomes).toMatchObject([
        { status: 'fulfilled', value: { id: 2, value: 'initial' } },
        { status: 'rejected', reason: expect.any(InvalidArgumentError) },
        { status: 'fulfilled', value: { status: 'applied' } },
      ]);
    });

    it('calls one after another on one transaction, and overlapping updates without a savepoint, all apply', async () => {
      await reset();
      const db = (t as TestDatabase).db;
      const repo = (tx: Database) => fencedRepository(tx, resource, { sameFence: 'allow' });
      await db.transaction(async (tx) => {
        const r = repo(tx as unknown as Database);
        expect(await r.modify({ id: 1 }, fence, async () => ({ value: 'one' }))).toMatchObject({ status: 'applied' });
        const both = await Promise.all([
          r.update({ id: 2 }, fence, { value: 'two' }),
          r.update({ id: 3 }, fence, { value: 'three' }),
        ]);
        expect(both.map((b) => b.status)).toEqual(['applied', 'applied']);
        // Inside a modify's function, a repository on the same transaction joins the savepoint.
        expect(
          await r.modify({ id: 4 }, fence, async () => {
            expect(await r.update({ id: 5 }, fence, { value: 'five' })).toMatchObject({ status: 'applied' });
            return { value: 'four' };
          }),
        ).toMatchObject({ status: 'applied' });
      });
      const rows = await execute(db, sql`select value from resource where id <= 5 order by id`);
      expect(rows.map((r) => r.value)).toEqual(['one', 'two', 'three', 'four', 'five']);
    });
  });
}
