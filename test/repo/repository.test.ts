/**
 * The fenced repository on every driver we support (PGlite always, the real
 * Postgres when DATABASE_URL is set). One database per file; every test
 * makes tables of its own.
 */
import { eq, getTableName, sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Database } from '../../src/driver.js';
import { InvalidArgumentError, RowMissingError, StaleFenceError } from '../../src/errors.js';
import { type Fence, MAX_FENCE, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository, type RepositoryOptions, type StaleWriteEvent } from '../../src/repo/repository.js';
import { mustApply } from '../../src/repo/result.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { drivers, type TestDatabase } from '../support/databases.js';
import { createAccounts, createLines, storedRow, uniqueName, withQueryLog } from './fixtures.js';

const f = (n: number | bigint): Fence => toFence(n);

/** What a call settled with: its error, 'resolved', or what it threw before returning a promise. */
async function outcome(call: () => Promise<unknown>): Promise<unknown> {
  let promise: Promise<unknown>;
  try {
    promise = call();
  } catch (thrown) {
    return { thrownSynchronously: thrown };
  }
  return promise.then(
    () => 'resolved',
    (e: unknown) => e,
  );
}

describe.each(drivers)('fenced repository on $name', ({ open }) => {
  let test: TestDatabase;
  let db: Database;

  beforeAll(async () => {
    test = await open();
    db = test.db;
    // Upserts read the tombstone floor (palisade.tombstone_floors).
    await migrate(db);
  });
  afterAll(async () => {
    await test?.close();
  });

  /** A fresh accounts table holding account `a` (owner ann, balance 100) written by fence 5. */
  async function accountA(options?: RepositoryOptions) {
    const t = await createAccounts(db);
    const repo = fencedRepository(db, t, options);
    mustApply(await repo.upsert({ id: 'a', owner: 'ann', balance: 100 }, f(5)));
    return { t, repo };
  }

  describe('update', () => {
    it('applied: writes the patch and the fence and returns the row', async () => {
      const { repo } = await accountA();
      const result = await repo.update({ id: 'a' }, f(6), { balance: 150 });
      expect(result).toEqual({
        status: 'applied',
        row: expect.objectContaining({ id: 'a', owner: 'ann', balance: 150, lastFence: 6n, deletedAt: null }),
      });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 150, lastFence: 6n });
    });

    it('stale: a lower fence is refused and learns the current fence', async () => {
      const { repo } = await accountA();
      expect(await repo.update({ id: 'a' }, f(4), { balance: 0 })).toEqual({ status: 'stale', currentFence: 5n });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100, lastFence: 5n });
    });

    it('duplicate: a retry with the same fence writes nothing', async () => {
      const { repo } = await accountA();
      expect(await repo.update({ id: 'a' }, f(5), { balance: 0 })).toEqual({ status: 'duplicate' });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100, lastFence: 5n });
    });

    it('missing: no row with that key, and none is created', async () => {
      const { t, repo } = await accountA();
      expect(await repo.update({ id: 'nobody' }, f(9), { balance: 1 })).toEqual({ status: 'missing' });
      expect(await storedRow(db, t, 'nobody')).toBeUndefined();
    });

    it('sets nullable columns to SQL NULL', async () => {
      const { t, repo } = await accountA();
      const closed = new Date('2024-05-01T12:00:00Z');
      mustApply(await repo.update({ id: 'a' }, f(6), { closedAt: closed, meta: { tier: 'gold' } }));
      expect(await repo.get({ id: 'a' })).toMatchObject({ closedAt: closed, meta: { tier: 'gold' } });

      const result = await repo.update({ id: 'a' }, f(7), { closedAt: null, meta: null });
      expect(result.status).toBe('applied');
      expect(await repo.get({ id: 'a' })).toMatchObject({ closedAt: null, meta: null, lastFence: 7n });
      // SQL NULL, not the JSON value null.
      const [row] = await db
        .select({ isNull: sql<boolean>`${t.meta} is null` })
        .from(t)
        .where(eq(t.id, 'a'));
      expect(row?.isNull).toBe(true);
    });
    // Found by an outside review: the template of an SQL expression recorded a placeholder but not
    // how its value is encoded, so a jsonb comparison built by eq() (the value encoded as JSON) and
    // the same text with a raw string shared one compiled statement, and the second call's value was
    // encoded the first call's way: a wrong value stored, reported applied.
    it('SQL expressions of one shape whose values encode differently each write what they say', async () => {
      for (const order of [
        ['eq', 'raw'],
        ['raw', 'eq'],
      ]) {
        const { t, repo } = await accountA();
        mustApply(await repo.update({ id: 'a' }, f(6), { meta: 'x' })); // the JSON string "x"
        const patch = {
          eq: () => ({ owner: sql`case when ${eq(t.meta, 'x')} then ${'hit'} else ${'miss'} end` }),
          raw: () => ({ owner: sql`case when ${sql`${t.meta} = ${'"x"'}`} then ${'hit'} else ${'miss'} end` }),
        };
        let fence = 7;
        for (const which of order as ('eq' | 'raw')[]) {
          mustApply(await repo.update({ id: 'a' }, f(fence++), { owner: 'unset' }));
          mustApply(await repo.update({ id: 'a' }, f(fence++), patch[which]()));
          expect({ which, owner: (await repo.get({ id: 'a' }))?.owner }).toEqual({ which, owner: 'hit' });
        }
      }
    });
  });

  describe('upsert', () => {
    it('applied: inserts a fresh row carrying the fence, defaults for columns not given', async () => {
      const t = await createAccounts(db);
      const repo = fencedRepository(db, t);
      const result = await repo.upsert({ id: 'b', balance: 7 }, f(3));
      expect(result).toEqual({
        status: 'applied',
        row: expect.objectContaining({ id: 'b', owner: 'nobody', balance: 7, meta: null, lastFence: 3n }),
      });
      expect(await repo.get({ id: 'b' })).toMatchObject({ balance: 7, lastFence: 3n });
    });

    it('applied: a higher fence updates the row; columns not given keep their values', async () => {
      const { repo } = await accountA();
      const result = await repo.upsert({ id: 'a', balance: 1 }, f(6));
      expect(result).toEqual({ status: 'applied', row: expect.objectContaining({ owner: 'ann', balance: 1 }) });
      expect(await repo.get({ id: 'a' })).toMatchObject({ owner: 'ann', balance: 1, lastFence: 6n });
    });

    it('stale: a lower fence neither inserts nor updates', async () => {
      const { repo } = await accountA();
      expect(await repo.upsert({ id: 'a', balance: 1 }, f(4))).toEqual({ status: 'stale', currentFence: 5n });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100, lastFence: 5n });
    });

    it('duplicate: the same fence again writes nothing', async () => {
      const { repo } = await accountA();
      expect(await repo.upsert({ id: 'a', balance: 1 }, f(5))).toEqual({ status: 'duplicate' });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100 });
    });
  });

  describe('delete', () => {
    it('applied: returns the deleted row, which get no longer sees', async () => {
      const { repo } = await accountA();
      const result = await repo.delete({ id: 'a' }, f(6));
      expect(result).toEqual({
        status: 'applied',
        row: expect.objectContaining({ id: 'a', balance: 100, lastFence: 6n, deletedAt: expect.any(Date) }),
      });
      expect(await repo.get({ id: 'a' })).toBeUndefined();
    });

    it('stale: a lower fence does not delete', async () => {
      const { repo } = await accountA();
      expect(await repo.delete({ id: 'a' }, f(4))).toEqual({ status: 'stale', currentFence: 5n });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100, lastFence: 5n });
    });

    it('duplicate: the fence that wrote the row cannot delete it', async () => {
      const { repo } = await accountA();
      expect(await repo.delete({ id: 'a' }, f(5))).toEqual({ status: 'duplicate' });
      expect(await repo.get({ id: 'a' })).toBeDefined();
    });

    it('missing: no such row, or already deleted', async () => {
      const { repo } = await accountA();
      expect(await repo.delete({ id: 'nobody' }, f(6))).toEqual({ status: 'missing' });
      mustApply(await repo.delete({ id: 'a' }, f(6)));
      expect(await repo.delete({ id: 'a' }, f(7))).toEqual({ status: 'missing' });
    });
  });

  describe('modify', () => {
    it('applied: computes the patch from the locked row', async () => {
      const { repo } = await accountA();
      const seen: number[] = [];
      const result = await repo.modify({ id: 'a' }, f(6), (row) => {
        seen.push(row.balance);
        return { balance: row.balance + 1 };
      });
      expect(seen).toEqual([100]);
      expect(result).toEqual({ status: 'applied', row: expect.objectContaining({ balance: 101, lastFence: 6n }) });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 101, lastFence: 6n });
    });

    it('stale, duplicate, missing: the function is not called and nothing is written', async () => {
      const { repo } = await accountA();
      let calls = 0;
      const addOne = (row: { balance: number }) => {
        calls++;
        return { balance: row.balance + 1 };
      };
      expect(await repo.modify({ id: 'a' }, f(4), addOne)).toEqual({ status: 'stale', currentFence: 5n });
      expect(await repo.modify({ id: 'a' }, f(5), addOne)).toEqual({ status: 'duplicate' });
      expect(await repo.modify({ id: 'nobody' }, f(6), addOne)).toEqual({ status: 'missing' });
      expect(calls).toBe(0);
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100, lastFence: 5n });
    });

    it("the function's own error rolls back and reaches the caller unchanged", async () => {
      const { t, repo } = await accountA();
      class InsufficientFunds extends Error {}
      const refusal = new InsufficientFunds('balance too low');
      await expect(
        repo.modify({ id: 'a' }, f(6), () => {
          throw refusal;
        }),
      ).rejects.toBe(refusal);
      expect(await storedRow(db, t, 'a')).toMatchObject({ balance: 100, lastFence: 5n });
    });

    it('fn gets the transaction; repositories on the same db join it while fn runs (no hang on PGlite)', async () => {
      const { t, repo } = await accountA();
      const other = fencedRepository(db, t);
      const result = await repo.modify({ id: 'a' }, f(6), async (row, tx) => {
        const viaRepo = await repo.get({ id: 'a' });
        const [viaTx] = await tx.select().from(t).where(eq(t.id, 'a'));
        mustApply(await other.upsert({ id: 'side', balance: 1 }, f(6)));
        const seenInside = await other.find(eq(t.id, 'side'));
        return {
          balance: row.balance + (viaRepo?.balance ?? 0) + (viaTx?.balance ?? 0) + (seenInside[0]?.balance ?? 0),
        };
      });
      expect(result).toMatchObject({ status: 'applied', row: { balance: 301, lastFence: 6n } });

      // What joined the transaction rolls back with it.
      const refusal = new Error('changed my mind');
      await expect(
        repo.modify({ id: 'a' }, f(7), async () => {
          mustApply(await other.upsert({ id: 'side2', balance: 1 }, f(7)));
          throw refusal;
        }),
      ).rejects.toBe(refusal);
      expect(await storedRow(db, t, 'side2')).toBeUndefined();
      // Outside fn the repositories use the database again.
      expect(await other.get({ id: 'side' })).toMatchObject({ balance: 1 });
    }, 30_000);

    it('a patch the function returns is validated; a bad one rolls back', async () => {
      const { repo } = await accountA();
      await expect(repo.modify({ id: 'a' }, f(6), () => ({ lastFence: 99n }) as never)).rejects.toThrow(
        InvalidArgumentError,
      );
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100, lastFence: 5n });
    });
  });

  describe('composite primary keys', () => {
    it('addresses a row by every key column', async () => {
      const t = await createLines(db);
      const repo = fencedRepository(db, t);
      for (const [orderId, lineNo] of [
        ['o1', 1],
        ['o1', 2],
        ['o2', 1],
      ] as const) {
        mustApply(await repo.upsert({ orderId, lineNo, qty: 1 }, f(1)));
      }

      expect(await repo.update({ orderId: 'o1', lineNo: 2 }, f(2), { qty: 9 })).toEqual({
        status: 'applied',
        row: expect.objectContaining({ orderId: 'o1', lineNo: 2, qty: 9, lastFence: 2n }),
      });
      expect(await repo.update({ orderId: 'o1', lineNo: 2 }, f(1), { qty: 0 })).toEqual({
        status: 'stale',
        currentFence: 2n,
      });
      expect(await repo.update({ orderId: 'o3', lineNo: 2 }, f(3), { qty: 0 })).toEqual({ status: 'missing' });
      expect(await repo.get({ orderId: 'o1', lineNo: 1 })).toMatchObject({ qty: 1, lastFence: 1n });
      expect(await repo.get({ orderId: 'o2', lineNo: 1 })).toMatchObject({ qty: 1, lastFence: 1n });

      mustApply(await repo.delete({ orderId: 'o1', lineNo: 1 }, f(3)));
      const live = await repo.find();
      expect(live.map((r) => [r.orderId, r.lineNo, r.qty]).sort()).toEqual([
        ['o1', 2, 9],
        ['o2', 1, 1],
      ]);
    });
  });

  describe('tombstones', () => {
    it('delete keeps a tombstone with the fence; get and find do not see it', async () => {
      const { t, repo } = await accountA();
      mustApply(await repo.upsert({ id: 'b', balance: 2 }, f(5)));
      mustApply(await repo.delete({ id: 'a' }, f(6)));

      expect(await storedRow(db, t, 'a')).toMatchObject({ lastFence: 6n, deletedAt: expect.any(Date) });
      expect(await repo.get({ id: 'a' })).toBeUndefined();
      expect((await repo.find()).map((r) => r.id)).toEqual(['b']);
      expect(await repo.find(eq(t.id, 'a'))).toEqual([]);
    });

    it('an upsert with a fence at or below the tombstone cannot resurrect the row', async () => {
      const { t, repo } = await accountA();
      mustApply(await repo.delete({ id: 'a' }, f(6)));

      expect(await repo.upsert({ id: 'a', balance: 1 }, f(5))).toEqual({ status: 'stale', currentFence: 6n });
      expect(await repo.upsert({ id: 'a', balance: 1 }, f(6))).toEqual({ status: 'duplicate' });
      expect(await repo.get({ id: 'a' })).toBeUndefined();
      expect(await storedRow(db, t, 'a')).toMatchObject({ balance: 100, lastFence: 6n, deletedAt: expect.any(Date) });
    });

    it('a higher fence resurrects it as a new row, without the deleted values', async () => {
      const { repo } = await accountA();
      mustApply(await repo.update({ id: 'a' }, f(6), { meta: { note: 'secret' } }));
      mustApply(await repo.delete({ id: 'a' }, f(7)));

      const result = await repo.upsert({ id: 'a', balance: 1 }, f(8));
      expect(result.status).toBe('applied');
      expect(await repo.get({ id: 'a' })).toEqual({
        id: 'a',
        owner: 'nobody',
        balance: 1,
        meta: null,
        closedAt: null,
        lastFence: 8n,
        deletedAt: null,
      });
    });

    it('update, modify and delete on a tombstone report missing and write nothing: the same fence may then upsert', async () => {
      const { t, repo } = await accountA();
      mustApply(await repo.delete({ id: 'a' }, f(6)));
      const addOne = (row: { balance: number }) => ({ balance: row.balance + 1 });

      expect(await repo.update({ id: 'a' }, f(7), { balance: 1 })).toEqual({ status: 'missing' });
      expect(await repo.modify({ id: 'a' }, f(7), addOne)).toEqual({ status: 'missing' });
      expect(await repo.delete({ id: 'a' }, f(7))).toEqual({ status: 'missing' });
      // Nothing moved: the tombstone still carries the deleting fence.
      expect(await storedRow(db, t, 'a')).toMatchObject({ lastFence: 6n, deletedAt: expect.any(Date) });
      // duplicate means "this fence wrote this row": fence 7 wrote nothing, so its upsert applies.
      expect(await repo.upsert({ id: 'a', balance: 1 }, f(7))).toMatchObject({
        status: 'applied',
        row: { balance: 1, lastFence: 7n },
      });
    });

    it('a retried delete reports missing; the deleting fence cannot resurrect its own tombstone', async () => {
      const { repo } = await accountA();
      mustApply(await repo.delete({ id: 'a' }, f(6)));
      expect(await repo.delete({ id: 'a' }, f(6))).toEqual({ status: 'missing' });
      expect(await repo.upsert({ id: 'a', balance: 1 }, f(6))).toEqual({ status: 'duplicate' });
    });

    it("with sameFence 'allow', a fence may delete and then recreate the row; a lower one may not", async () => {
      const { t, repo: strict } = await accountA();
      const repo = fencedRepository(db, t, { sameFence: 'allow' });
      mustApply(await strict.delete({ id: 'a' }, f(6)));
      expect(await repo.update({ id: 'a' }, f(6), { balance: 1 })).toEqual({ status: 'missing' });
      expect(await repo.upsert({ id: 'a', balance: 1 }, f(5))).toEqual({ status: 'stale', currentFence: 6n });
      expect((await repo.upsert({ id: 'a', balance: 1 }, f(6))).status).toBe('applied');
    });
  });

  describe('purgeTombstones', () => {
    it('removes tombstones older than the cut-off in batches, never live rows', async () => {
      const { t, repo } = await accountA();
      mustApply(await repo.upsert({ id: 'b', balance: 2 }, f(5)));
      mustApply(await repo.upsert({ id: 'c', balance: 3 }, f(5)));
      mustApply(await repo.delete({ id: 'a' }, f(6)));
      mustApply(await repo.delete({ id: 'b' }, f(6)));

      const anHourAgo = new Date(Date.now() - 3_600_000);
      expect(await repo.purgeTombstones(anHourAgo)).toBe(0);

      const inAnHour = new Date(Date.now() + 3_600_000);
      const removed: number[] = [];
      for (let i = 0; i < 5; i++) {
        const n = await repo.purgeTombstones(inAnHour, { batchSize: 1 });
        removed.push(n);
        if (n === 0) break;
      }
      expect(removed).toEqual([1, 1, 0]);
      expect(await storedRow(db, t, 'a')).toBeUndefined();
      expect(await storedRow(db, t, 'b')).toBeUndefined();
      expect(await repo.get({ id: 'c' })).toMatchObject({ balance: 3 });
    });

    it('raises the tombstone floor to the highest fence it removed: no lower fence recreates a purged row', async () => {
      const { t, repo } = await accountA();
      mustApply(await repo.upsert({ id: 'b', balance: 2 }, f(5)));
      mustApply(await repo.upsert({ id: 'c', balance: 3 }, f(5)));
      mustApply(await repo.delete({ id: 'a' }, f(9)));
      mustApply(await repo.delete({ id: 'b' }, f(7)));
      expect(await repo.purgeTombstones(new Date(Date.now() + 3_600_000))).toBe(2);

      // Whatever the cut-off, a stale fence must still beat the highest fence purged.
      expect(await repo.upsert({ id: 'a', balance: 1 }, f(8))).toEqual({ status: 'stale', currentFence: 9n });
      expect(await repo.upsert({ id: 'b', balance: 1 }, f(8))).toEqual({ status: 'stale', currentFence: 9n });
      expect(await repo.upsert({ id: 'new', balance: 1 }, f(9))).toEqual({ status: 'stale', currentFence: 9n });
      expect(await storedRow(db, t, 'a')).toBeUndefined();
      // Live rows are not held back by the floor: fence 8 still writes c (written by 5).
      mustApply(await repo.upsert({ id: 'c', balance: 4 }, f(8)));
      expect((await repo.upsert({ id: 'a', balance: 1 }, f(10))).status).toBe('applied');

      // A purge of lower fences never lowers the floor.
      mustApply(await repo.delete({ id: 'c' }, f(10)));
      mustApply(await repo.delete({ id: 'a' }, f(11)));
      await repo.purgeTombstones(new Date(Date.now() + 3_600_000));
      expect(await repo.upsert({ id: 'c', balance: 1 }, f(11))).toEqual({ status: 'stale', currentFence: 11n });
      const [floor] = await db
        .execute(
          sql`select floor::text as floor from palisade.tombstone_floors where fenced_table = ${getTableName(t)}::regclass`,
        )
        .then((r) => (Array.isArray(r) ? r : (r as { rows: unknown[] }).rows) as { floor: string }[]);
      expect(floor?.floor).toBe('11');
    });

    it('refuses a bad cut-off or batch size', async () => {
      const { repo } = await accountA();
      await expect(repo.purgeTombstones(new Date('not a date'))).rejects.toThrow(InvalidArgumentError);
      await expect(repo.purgeTombstones(new Date(), { batchSize: 0 })).rejects.toThrow(InvalidArgumentError);
    });
  });

  describe('updateWhere', () => {
    /** x1, x2 at fence 1; x9 at fence 9 (owner x); y1 (owner y); xdead: a tombstone of owner x. */
    async function owners() {
      const t = await createAccounts(db);
      const repo = fencedRepository(db, t);
      mustApply(await repo.upsert({ id: 'x1', owner: 'x', balance: 1 }, f(1)));
      mustApply(await repo.upsert({ id: 'x2', owner: 'x', balance: 2 }, f(1)));
      mustApply(await repo.upsert({ id: 'x9', owner: 'x', balance: 9 }, f(9)));
      mustApply(await repo.upsert({ id: 'y1', owner: 'y', balance: 1 }, f(1)));
      mustApply(await repo.upsert({ id: 'xdead', owner: 'x', balance: 0 }, f(1)));
      mustApply(await repo.delete({ id: 'xdead' }, f(2)));
      const balances = async () =>
        Object.fromEntries(
          (await db.select().from(t).orderBy(t.id)).map((r) => [r.id, [r.balance, r.lastFence] as const]),
        );
      return { t, repo, balances };
    }

    it('counts applied and stale rows; tombstones and rows outside the condition are untouched', async () => {
      const { t, repo, balances } = await owners();
      expect(await repo.updateWhere(eq(t.owner, 'x'), f(5), { balance: sql`${t.balance} * 10` })).toEqual({
        applied: 2,
        stale: 1,
      });
      expect(await balances()).toEqual({
        x1: [10, 5n],
        x2: [20, 5n],
        x9: [9, 9n],
        xdead: [0, 2n],
        y1: [1, 1n],
      });
    });

    it('allOrNothing: nothing is written when any matching row is stale', async () => {
      const { t, repo, balances } = await owners();
      const before = await balances();
      expect(await repo.updateWhere(eq(t.owner, 'x'), f(5), { balance: 0 }, { allOrNothing: true })).toEqual({
        applied: 0,
        stale: 1,
      });
      expect(await balances()).toEqual(before);

      expect(await repo.updateWhere(eq(t.owner, 'x'), f(10), { balance: 0 }, { allOrNothing: true })).toEqual({
        applied: 3,
        stale: 0,
      });
      expect(await balances()).toMatchObject({ x1: [0, 10n], x2: [0, 10n], x9: [0, 10n], y1: [1, 1n] });
    });
    it("a key column named like palisade's own aliases (fence, deleted) does not confuse the statement", async () => {
      const name = uniqueName('clash');
      await db.execute(
        sql`create table ${sql.identifier(name)} (fence text primary key, deleted int not null, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      const t = pgTable(name, {
        fence: text('fence').primaryKey(),
        deleted: integer('deleted').notNull(),
        ...fenceColumns(),
      });
      const repo = fencedRepository(db, t);
      mustApply(await repo.upsert({ fence: 'f1', deleted: 0 }, f(1)));
      expect(await repo.updateWhere(sql`true`, f(2), { deleted: 1 }, { allOrNothing: true })).toEqual({
        applied: 1,
        stale: 0,
      });
      expect(await repo.update({ fence: 'f1' }, f(2), { deleted: 2 })).toEqual({ status: 'duplicate' });
    });
  });

  describe("sameFence: 'allow'", () => {
    it('lets one fence write a row several times and still refuses lower fences', async () => {
      const { repo } = await accountA({ sameFence: 'allow' });
      expect((await repo.update({ id: 'a' }, f(5), { balance: 1 })).status).toBe('applied');
      expect((await repo.update({ id: 'a' }, f(5), { balance: 2 })).status).toBe('applied');
      expect((await repo.upsert({ id: 'a', balance: 3 }, f(5))).status).toBe('applied');
      expect(await repo.modify({ id: 'a' }, f(5), (row) => ({ balance: row.balance + 1 }))).toEqual({
        status: 'applied',
        row: expect.objectContaining({ balance: 4 }),
      });
      expect(await repo.update({ id: 'a' }, f(4), { balance: 0 })).toEqual({ status: 'stale', currentFence: 5n });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 4, lastFence: 5n });
      expect((await repo.delete({ id: 'a' }, f(5))).status).toBe('applied');
    });

    it('refuses an unknown mode', async () => {
      const t = await createAccounts(db);
      expect(() => fencedRepository(db, t, { sameFence: 'sometimes' as never })).toThrow(InvalidArgumentError);
    });
  });

  describe('SQL expressions in patches', () => {
    it('computes the new value in the database, each expression its own', async () => {
      const { t, repo } = await accountA();
      expect(await repo.update({ id: 'a' }, f(6), { balance: sql`${t.balance} + 1` })).toEqual({
        status: 'applied',
        row: expect.objectContaining({ balance: 101 }),
      });
      mustApply(await repo.update({ id: 'a' }, f(7), { balance: sql`${t.balance} + 1` }));
      mustApply(await repo.update({ id: 'a' }, f(8), { balance: sql`${t.balance} * ${10}` }));
      expect(await repo.update({ id: 'a' }, f(7), { balance: sql`${t.balance} + 1` })).toEqual({
        status: 'stale',
        currentFence: 8n,
      });
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 1020, lastFence: 8n });
    });
  });

  describe("inside the caller's transaction", () => {
    it('joins it: the writes commit with it', async () => {
      const { t } = await accountA();
      await db.transaction(async (tx) => {
        const repo = fencedRepository(tx, t);
        mustApply(await repo.update({ id: 'a' }, f(6), { balance: 1 }));
        mustApply(await repo.upsert({ id: 'b', balance: 2 }, f(6)));
        mustApply(await repo.modify({ id: 'a' }, f(7), (row) => ({ balance: row.balance + 1 })));
      });
      const repo = fencedRepository(db, t);
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 2, lastFence: 7n });
      expect(await repo.get({ id: 'b' })).toMatchObject({ balance: 2, lastFence: 6n });
    });

    it('a rollback undoes the write, and the fence can write again', async () => {
      const { t, repo } = await accountA();
      const seenInside: unknown[] = [];
      await expect(
        db.transaction(async (tx) => {
          const inTx = fencedRepository(tx, t);
          mustApply(await inTx.update({ id: 'a' }, f(6), { balance: 0 }));
          mustApply(await inTx.delete({ id: 'a' }, f(7)));
          seenInside.push(await storedRow(tx, t, 'a'));
          tx.rollback();
        }),
      ).rejects.toThrow(/rollback/i);
      expect(seenInside).toEqual([expect.objectContaining({ balance: 0, lastFence: 7n, deletedAt: expect.any(Date) })]);
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 100, lastFence: 5n });
      expect((await repo.update({ id: 'a' }, f(6), { balance: 0 })).status).toBe('applied');
    });
  });

  describe('mustApply', () => {
    it('returns the row, or throws StaleFenceError / RowMissingError carrying what happened', async () => {
      const { t, repo } = await accountA();
      const table = getTableName(t);

      expect(mustApply(await repo.update({ id: 'a' }, f(6), { balance: 1 }))).toMatchObject({ balance: 1 });

      const stale = await repo.update({ id: 'a' }, f(4), { balance: 2 });
      expect(() => mustApply(stale)).toThrow(StaleFenceError);
      expect(() => mustApply(stale)).toThrow(
        expect.objectContaining({
          code: 'stale_fence',
          table,
          key: { id: 'a' },
          attemptedFence: 4n,
          currentFence: 6n,
        }),
      );

      const duplicate = await repo.update({ id: 'a' }, f(6), { balance: 2 });
      expect(() => mustApply(duplicate)).toThrow(
        expect.objectContaining({ code: 'stale_fence', attemptedFence: 6n, currentFence: 6n }),
      );

      const missing = await repo.update({ id: 'nobody' }, f(7), { balance: 2 });
      expect(() => mustApply(missing)).toThrow(RowMissingError);
      expect(() => mustApply(missing)).toThrow(expect.objectContaining({ code: 'row_missing', table }));
    });
  });

  describe('onStale', () => {
    it('reports every stale or duplicate write, and only those', async () => {
      const events: StaleWriteEvent[] = [];
      const { t, repo } = await accountA({ onStale: (e) => events.push(e) });
      const table = getTableName(t);

      await repo.update({ id: 'a' }, f(6), { balance: 1 }); // applied
      await repo.update({ id: 'a' }, f(4), { balance: 2 }); // stale
      await repo.upsert({ id: 'a', balance: 3 }, f(6)); // duplicate
      await repo.delete({ id: 'nobody' }, f(7)); // missing

      expect(events).toEqual([
        { table, key: { id: 'a' }, attemptedFence: 4n, currentFence: 6n },
        { table, key: { id: 'a' }, attemptedFence: 6n, currentFence: 6n },
      ]);
    });

    it('an observer that throws does not change the result', async () => {
      const { repo } = await accountA({
        onStale: () => {
          throw new Error('observer bug');
        },
      });
      expect(await repo.update({ id: 'a' }, f(4), { balance: 2 })).toEqual({ status: 'stale', currentFence: 5n });
    });
  });

  describe('repo.with(lease)', () => {
    it("writes with the holder's fence, and refuses locally once its signal aborts", async () => {
      const { t } = await accountA();
      const { db: logged, queries } = withQueryLog(test);
      const repo = fencedRepository(logged, t);
      const controller = new AbortController();
      const leased = repo.with({ fence: f(6), signal: controller.signal });

      expect(leased.fence).toBe(6n);
      expect(await leased.update({ id: 'a' }, { balance: 1 })).toEqual({
        status: 'applied',
        row: expect.objectContaining({ balance: 1, lastFence: 6n }),
      });
      expect(queries.length).toBeGreaterThan(0);
      queries.length = 0;

      // A reason that is not palisade's own becomes a LeaseLostError, so callers branch on one code.
      controller.abort(new Error('lease lost'));
      const lost = { code: 'lease_lost', fence: 6n };
      await expect(leased.update({ id: 'a' }, { balance: 2 })).rejects.toMatchObject(lost);
      await expect(leased.upsert({ id: 'a', balance: 2 })).rejects.toMatchObject(lost);
      await expect(leased.delete({ id: 'a' })).rejects.toMatchObject(lost);
      await expect(leased.modify({ id: 'a' }, () => ({ balance: 2 }))).rejects.toMatchObject(lost);
      await expect(leased.updateWhere(sql`true`, { balance: 2 })).rejects.toMatchObject(lost);
      expect(queries).toEqual([]);
      expect(await repo.get({ id: 'a' })).toMatchObject({ balance: 1, lastFence: 6n });
    });

    it('the database still refuses a lease whose fence is stale', async () => {
      const { repo } = await accountA();
      const leased = repo.with({ fence: f(4), signal: new AbortController().signal });
      expect(await leased.update({ id: 'a' }, { balance: 1 })).toEqual({ status: 'stale', currentFence: 5n });
    });
  });

  describe('64-bit fences', () => {
    it('2^53+1 and 2^63-1 are written and read back exactly', async () => {
      const t = await createAccounts(db);
      const repo = fencedRepository(db, t);
      const above53 = 2n ** 53n + 1n;

      mustApply(await repo.upsert({ id: 'a', balance: 1 }, f(above53)));
      expect((await repo.get({ id: 'a' }))?.lastFence).toBe(above53);
      // As doubles 2^53+1 and 2^53 are equal: only exact 64-bit values tell them apart.
      expect(await repo.update({ id: 'a' }, f(2n ** 53n), { balance: 2 })).toEqual({
        status: 'stale',
        currentFence: above53,
      });
      expect(await repo.update({ id: 'a' }, f(above53), { balance: 2 })).toEqual({ status: 'duplicate' });

      mustApply(await repo.update({ id: 'a' }, f(MAX_FENCE), { balance: 3 }));
      expect((await repo.get({ id: 'a' }))?.lastFence).toBe(2n ** 63n - 1n);
      expect(await repo.update({ id: 'a' }, f(MAX_FENCE - 1n), { balance: 4 })).toEqual({
        status: 'stale',
        currentFence: MAX_FENCE,
      });
    });
  });

  describe('bad input is refused before any query', () => {
    it('fences, patches, keys and options', async () => {
      const t = await createAccounts(db);
      const lines = await createLines(db);
      const { db: logged, queries } = withQueryLog(test);
      const repo = fencedRepository(logged, t);
      const lineRepo = fencedRepository(logged, lines);
      mustApply(await repo.upsert({ id: 'a', balance: 100 }, f(5)));
      mustApply(await lineRepo.upsert({ orderId: 'o', lineNo: 1, qty: 1 }, f(5)));
      expect(queries.length).toBeGreaterThan(0); // the log does record queries
      queries.length = 0;

      const key = { id: 'a' };
      const patch = { balance: 1 };
      const badFences = [5, 0n, -1n, 2n ** 63n, '6', null, undefined] as unknown as Fence[];
      const refusals: [string, () => Promise<unknown>][] = [
        ...badFences.flatMap((fence): [string, () => Promise<unknown>][] => [
          [`update fence ${String(fence)}`, () => repo.update(key, fence, patch)],
          [`upsert fence ${String(fence)}`, () => repo.upsert({ id: 'a', balance: 1 }, fence)],
          [`delete fence ${String(fence)}`, () => repo.delete(key, fence)],
          [`modify fence ${String(fence)}`, () => repo.modify(key, fence, () => patch)],
          [`updateWhere fence ${String(fence)}`, () => repo.updateWhere(sql`true`, fence, patch)],
        ]),
        ['patch sets lastFence', () => repo.update(key, f(6), { lastFence: 9n } as never)],
        ['patch sets last_fence', () => repo.update(key, f(6), { last_fence: 9n } as never)],
        ['patch sets deletedAt', () => repo.update(key, f(6), { deletedAt: null } as never)],
        ['patch sets deleted_at', () => repo.update(key, f(6), { deleted_at: null } as never)],
        ['upsert sets lastFence', () => repo.upsert({ id: 'a', balance: 1, lastFence: 9n } as never, f(6))],
        ['updateWhere sets lastFence', () => repo.updateWhere(sql`true`, f(6), { lastFence: 9n } as never)],
        ['patch changes the key', () => repo.update(key, f(6), { id: 'b' } as never)],
        ['updateWhere changes the key', () => repo.updateWhere(sql`true`, f(6), { id: 'b' } as never)],
        ['patch names an unknown column', () => repo.update(key, f(6), { nope: 1 } as never)],
        ['upsert names an unknown column', () => repo.upsert({ id: 'a', balance: 1, nope: 1 } as never, f(6))],
        ['patch is not an object', () => repo.update(key, f(6), null as never)],
        ['patch is SQL', () => repo.update(key, f(6), sql`balance = 1` as never)],
        ['key is empty', () => repo.update({}, f(6), patch)],
        ['key has a non-key column', () => repo.update({ id: 'a', owner: 'x' }, f(6), patch)],
        ['key value is null', () => repo.update({ id: null } as never, f(6), patch)],
        // Cached statements would keep the first call's expression: this wrote row a.
        ['key value is SQL', () => repo.update({ id: sql`'b'` } as never, f(6), patch)],
        ['delete key value is SQL', () => repo.delete({ id: sql`'b'` } as never, f(6))],
        ['key is not an object', () => repo.update('a' as never, f(6), patch)],
        ['upsert lacks the key', () => repo.upsert({ balance: 1 } as never, f(6))],
        ['delete key has a non-key column', () => repo.delete({ id: 'a', balance: 100 }, f(6))],
        ['modify key is empty', () => repo.modify({}, f(6), () => patch)],
        ['modify without a function', () => repo.modify(key, f(6), undefined as never)],
        ['get key has a non-key column', () => repo.get({ id: 'a', owner: 'x' })],
        ['updateWhere without a condition', () => repo.updateWhere(undefined as never, f(6), patch)],
        ['composite key lacks a column', () => lineRepo.update({ orderId: 'o' }, f(6), { qty: 2 })],
        [
          'composite key has an extra column',
          () => lineRepo.update({ orderId: 'o', lineNo: 1, qty: 1 }, f(6), { qty: 2 }),
        ],
        [
          'composite patch changes a key column',
          () => lineRepo.update({ orderId: 'o', lineNo: 1 }, f(6), { lineNo: 2 }),
        ],
      ];
      for (const [what, call] of refusals) {
        const error = await outcome(call);
        expect(error, what).toBeInstanceOf(InvalidArgumentError);
        expect((error as InvalidArgumentError).code, what).toBe('invalid_argument');
      }
      expect(() => repo.with({ fence: 6n as Fence, signal: new AbortController().signal })).not.toThrow();
      expect(() => repo.with({ fence: 6 as never, signal: new AbortController().signal })).toThrow(
        InvalidArgumentError,
      );
      expect(() => repo.with({ fence: f(6), signal: {} as never })).toThrow(InvalidArgumentError);
      // Lone surrogates would all be hashed as U+FFFD: two such lock identities would share one register.
      for (const [part, value] of [
        ['name', '\uD800'],
        ['source', 'db\uDC00'],
        ['kind', '\uDBFF'],
      ] as const) {
        const lock = { kind: 'k', source: 's', namespace: 'n', name: 'L', [part]: value };
        const lease = { fence: f(6), signal: new AbortController().signal, lock };
        expect(() => repo.with(lease), part).toThrow(/well-formed Unicode/);
      }

      expect(queries).toEqual([]);
      expect(await repo.get(key)).toMatchObject({ id: 'a', balance: 100, lastFence: 5n });
      expect(await lineRepo.get({ orderId: 'o', lineNo: 1 })).toMatchObject({ qty: 1, lastFence: 5n });
    });

    it('a table without fence columns or without a primary key is refused', () => {
      const unfenced = pgTable('unfenced', { id: text('id').primaryKey(), n: integer('n') });
      const keyless = pgTable('keyless', { id: text('id'), ...fenceColumns() });
      expect(() => fencedRepository(db, unfenced as never)).toThrow(InvalidArgumentError);
      expect(() => fencedRepository(db, keyless)).toThrow(InvalidArgumentError);
    });
  });
});
