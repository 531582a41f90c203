/**
 * Fenced writes under real concurrency: only the real Postgres blocks on row
 * locks (PGlite serialises every query). Interleavings are forced, not
 * hoped for: a blocker holds the row while the writers queue up behind it,
 * and the suite waits until Postgres shows them all waiting on the lock.
 */
import { fc } from '@fast-check/vitest';
import { eq, getTableName, sql } from 'drizzle-orm';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import postgres, { type Sql } from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { RetryableWriteError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { mustApply, type WriteResult } from '../../src/repo/result.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { type Accounts, createAccounts, storedRow } from './fixtures.js';

const f = (n: number | bigint): Fence => toFence(n);
describe.runIf(needs('DATABASE_URL'))('fenced writes under concurrency (real Postgres)', () => {
  let test: TestDatabase;
  let db: Database;
  /** One connection that holds row locks while the writers queue. */
  let blocker: Sql;
  /** One connection that watches pg_stat_activity. */
  let probe: Sql;

  beforeAll(async () => {
    test = await postgresDatabase();
    db = test.db;
    await migrate(db);
    blocker = postgres(test.url as string, { max: 1, onnotice: () => {} });
    probe = postgres(test.url as string, { max: 1, onnotice: () => {} });
  });
  afterAll(async () => {
    await blocker?.end({ timeout: 5 });
    await probe?.end({ timeout: 5 });
    await test?.close();
  });

  /** Returns once `count` statements on `table` wait on a lock (bounded: fails rather than waits forever). */
  async function untilWaiting(table: Accounts, count: number): Promise<void> {
    let seen = 0;
    for (let i = 0; i < 3000; i++) {
      const [row] = await probe`select count(*)::int as n from pg_stat_activity
        where datname = current_database() and wait_event_type = 'Lock' and query like ${`%${getTableName(table)}%`}`;
      seen = row?.n ?? 0;
      if (seen >= count) return;
      await sleep(10);
    }
    throw new Error(`only ${seen} of ${count} statements ever waited on a lock`);
  }

  /** An accounts table whose every insert and update appends the written fence to an audit trail, in write order. */
  async function auditedAccounts() {
    const t = await createAccounts(db);
    const name = getTableName(t);
    const audit = sql.identifier(`${name}_audit`);
    await db.execute(sql`create table ${audit} (seq bigserial primary key, fence bigint not null)`);
    await db.execute(sql`create function ${audit}() returns trigger language plpgsql as $$
      begin insert into ${audit} (fence) values (new.last_fence); return null; end $$`);
    await db.execute(
      sql`create trigger audit after insert or update on ${sql.identifier(name)} for each row execute function ${audit}()`,
    );
    // The row lock serialises writers of one row, so trigger order is the order the writes applied in.
    const trail = async () =>
      (await execute(db, sql`select fence::text as fence from ${audit} order by seq`)).map((r) =>
        BigInt(String(r.fence)),
      );
    return { t, trail };
  }

  function checkHistory(fences: number[], results: WriteResult<unknown>[], trail: bigint[], initial: bigint[]) {
    const highest = BigInt(Math.max(...fences));
    const written = trail.slice(initial.length);
    expect(trail.slice(0, initial.length)).toEqual(initial);
    // No write with a lower fence applied after a higher one...
    for (let i = 1; i < written.length; i++) expect(written[i]).toBeGreaterThan(written[i - 1] as bigint);
    // ...and the last one to apply is the highest.
    expect(written.at(-1)).toBe(highest);
    // What applied is exactly what the trail saw; everything else was refused with a reason that holds.
    const applied = fences.filter((_, i) => results[i]?.status === 'applied').map(BigInt);
    expect([...applied].sort()).toEqual([...written].sort());
    results.forEach((result, i) => {
      const fence = BigInt(fences[i] as number);
      if (result.status === 'stale') {
        expect(result.currentFence).toBeGreaterThan(fence);
        expect([...initial, ...written]).toContain(result.currentFence);
      } else if (result.status === 'duplicate') {
        expect(written).toContain(fence);
      } else {
        expect(result.status).toBe('applied');
      }
    });
  }

  it('20 writers with shuffled fences on one row leave it at the highest fence', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(fc.integer({ min: 2, max: 40 }), { minLength: 20, maxLength: 20 }), async (fences) => {
        const { t, trail } = await auditedAccounts();
        const repo = fencedRepository(db, t);
        mustApply(await repo.upsert({ id: 'hot', balance: 1 }, f(1)));

        const held = await blocker.reserve();
        let settled: Promise<PromiseSettledResult<WriteResult<unknown>>[]>;
        try {
          await held`begin`;
          await held`select 1 from ${held(getTableName(t))} where id = 'hot' for update`;
          settled = Promise.allSettled(fences.map((n) => repo.update({ id: 'hot' }, f(n), { balance: n })));
          await untilWaiting(t, fences.length);
        } finally {
          await held`commit`;
          held.release();
        }
        const results = (await settled).map((s) => (s.status === 'fulfilled' ? s.value : { status: String(s.reason) }));

        checkHistory(fences, results as WriteResult<unknown>[], await trail(), [1n]);
        const highest = Math.max(...fences);
        expect(await repo.get({ id: 'hot' })).toMatchObject({ balance: highest, lastFence: BigInt(highest) });
      }),
      { numRuns: 3 },
    );
  });

  it('20 upserts with shuffled fences racing to create one row leave it at the highest fence', async () => {
    await fc.assert(
      fc.asyncProperty(fc.array(fc.integer({ min: 1, max: 40 }), { minLength: 20, maxLength: 20 }), async (fences) => {
        const { t, trail } = await auditedAccounts();
        const repo = fencedRepository(db, t);

        // An uncommitted insert of the same key makes every upsert wait; rolling it back lets them race.
        const held = await blocker.reserve();
        let settled: Promise<PromiseSettledResult<WriteResult<unknown>>[]>;
        try {
          await held`begin`;
          await held`insert into ${held(getTableName(t))} (id) values ('hot')`;
          settled = Promise.allSettled(fences.map((n) => repo.upsert({ id: 'hot', balance: n }, f(n))));
          await untilWaiting(t, fences.length);
        } finally {
          await held`rollback`;
          held.release();
        }
        const results = (await settled).map((s) => (s.status === 'fulfilled' ? s.value : { status: String(s.reason) }));

        checkHistory(fences, results as WriteResult<unknown>[], await trail(), []);
        const highest = Math.max(...fences);
        expect(await repo.get({ id: 'hot' })).toMatchObject({ balance: highest, lastFence: BigInt(highest) });
      }),
      { numRuns: 3 },
    );
  });

  it('10 concurrent modify(+1) with distinct fences: the counter equals the number applied', async () => {
    const distinct = Array.from({ length: 30 }, (_, i) => i + 2);
    await fc.assert(
      fc.asyncProperty(fc.shuffledSubarray(distinct, { minLength: 10, maxLength: 10 }), async (fences) => {
        const t = await createAccounts(db);
        const repo = fencedRepository(db, t);
        mustApply(await repo.upsert({ id: 'counter', balance: 0 }, f(1)));
        let calls = 0;

        const held = await blocker.reserve();
        let settled: Promise<PromiseSettledResult<WriteResult<{ balance: number }>>[]>;
        try {
          await held`begin`;
          await held`select 1 from ${held(getTableName(t))} where id = 'counter' for update`;
          settled = Promise.allSettled(
            fences.map((n) =>
              repo.modify({ id: 'counter' }, f(n), (row) => {
                calls++;
                return { balance: row.balance + 1 };
              }),
            ),
          );
          await untilWaiting(t, fences.length);
        } finally {
          await held`commit`;
          held.release();
        }
        const results = (await settled).map((s) => (s.status === 'fulfilled' ? s.value : { status: String(s.reason) }));

        const applied = results.flatMap((r) => (r.status === 'applied' && 'row' in r ? [r.row.balance] : []));
        expect(applied.length).toBeGreaterThan(0);
        expect(results.filter((r) => r.status !== 'applied').every((r) => r.status === 'stale')).toBe(true);
        expect(calls).toBe(applied.length);
        // Each applied increment saw the one before it: no two read the same value.
        expect([...applied].sort((a, b) => a - b)).toEqual(Array.from({ length: applied.length }, (_, i) => i + 1));
        expect(await repo.get({ id: 'counter' })).toMatchObject({ balance: applied.length });
      }),
      { numRuns: 3 },
    );
  });

  describe('the lost update that fencing the write alone does not stop', () => {
    // The stale holder (fence 2) read the counter before it paused; the new
    // holder (fence 3) reads before the stale write lands.

    it('naive get + update: both writes apply and one increment is lost', async () => {
      const t = await createAccounts(db);
      const repo = fencedRepository(db, t);
      mustApply(await repo.upsert({ id: 'counter', balance: 0 }, f(1)));
      const key = { id: 'counter' };

      const staleRead = await repo.get(key); // the old holder, before its pause
      const newRead = await repo.get(key); // the new holder, before the stale write lands
      const staleWrite = await repo.update(key, f(2), { balance: (staleRead?.balance ?? 0) + 1 });
      const newWrite = await repo.update(key, f(3), { balance: (newRead?.balance ?? 0) + 1 });

      expect([staleWrite.status, newWrite.status]).toEqual(['applied', 'applied']);
      expect(await repo.get(key)).toMatchObject({ balance: 1, lastFence: 3n }); // two increments, counter 1
    });

    it("modify: the new holder's read waits for the stale holder's write and follows it", async () => {
      const t = await createAccounts(db);
      const repo = fencedRepository(db, t);
      mustApply(await repo.upsert({ id: 'counter', balance: 0 }, f(1)));
      const key = { id: 'counter' };

      let staleHasLock!: () => void;
      const staleLocked = new Promise<void>((resolve) => {
        staleHasLock = resolve;
      });
      let resumeStale!: () => void;
      const staleResumed = new Promise<void>((resolve) => {
        resumeStale = resolve;
      });
      const newSaw: { balance: number; lastFence: bigint }[] = [];

      const staleWrite = repo.modify(key, f(2), async (row) => {
        staleHasLock();
        await staleResumed; // the pause, while holding the row lock
        return { balance: row.balance + 1 };
      });
      await staleLocked;
      const newWrite = repo.modify(key, f(3), (row) => {
        newSaw.push({ balance: row.balance, lastFence: row.lastFence });
        return { balance: row.balance + 1 };
      });
      await untilWaiting(t, 1);
      expect(newSaw).toEqual([]); // still waiting for the row
      resumeStale();

      expect((await staleWrite).status).toBe('applied');
      expect((await newWrite).status).toBe('applied');
      expect(newSaw).toEqual([{ balance: 1, lastFence: 2n }]);
      expect(await repo.get(key)).toMatchObject({ balance: 2, lastFence: 3n }); // no increment lost
    });

    it("modify: a stale write that lands during the new holder's modify waits, then is refused", async () => {
      const t = await createAccounts(db);
      const repo = fencedRepository(db, t);
      mustApply(await repo.upsert({ id: 'counter', balance: 0 }, f(1)));
      const key = { id: 'counter' };

      const staleRead = await repo.get(key);
      let newHasLock!: () => void;
      const newLocked = new Promise<void>((resolve) => {
        newHasLock = resolve;
      });
      let resumeNew!: () => void;
      const newResumed = new Promise<void>((resolve) => {
        resumeNew = resolve;
      });

      const newWrite = repo.modify(key, f(3), async (row) => {
        newHasLock();
        await newResumed;
        return { balance: row.balance + 1 };
      });
      await newLocked;
      const staleWrite = repo.update(key, f(2), { balance: (staleRead?.balance ?? 0) + 1 });
      await untilWaiting(t, 1);
      resumeNew();

      expect((await newWrite).status).toBe('applied');
      expect(await staleWrite).toEqual({ status: 'stale', currentFence: 3n });
      expect(await repo.get(key)).toMatchObject({ balance: 1, lastFence: 3n });
    });
  });

  it('updateWhere does not write a row a concurrent holder deleted while it waited', async () => {
    const t = await createAccounts(db);
    const repo = fencedRepository(db, t);
    mustApply(await repo.upsert({ id: 'x1', owner: 'x', balance: 1 }, f(1)));
    mustApply(await repo.upsert({ id: 'x2', owner: 'x', balance: 2 }, f(1)));

    const held = await blocker.reserve();
    let batch: Promise<{ applied: number; stale: number }>;
    try {
      await held`begin`;
      // Another holder's fenced delete (fence 3, as the repository writes it), not yet committed
      // when the batch takes its snapshot.
      await held`update ${held(getTableName(t))} set deleted_at = now(), last_fence = 3
        where id = 'x1' and last_fence < 3`;
      batch = repo.updateWhere(eq(t.owner, 'x'), f(5), { balance: 0 });
      await untilWaiting(t, 1);
    } finally {
      await held`commit`;
      held.release();
    }

    expect(await batch).toEqual({ applied: 1, stale: 1 });
    expect(await repo.get({ id: 'x1' })).toBeUndefined();
    expect(await storedRow(db, t, 'x1')).toMatchObject({ balance: 1, lastFence: 3n, deletedAt: expect.any(Date) });
    expect(await repo.get({ id: 'x2' })).toMatchObject({ balance: 0, lastFence: 5n });
  });

  it('under REPEATABLE READ a concurrent fenced write surfaces as retryable, not stale', async () => {
    const t = await createAccounts(db);
    const repo = fencedRepository(db, t);
    mustApply(await repo.upsert({ id: 'a', balance: 0 }, f(1)));

    const attempt = db.transaction(
      async (tx) => {
        const inTx = fencedRepository(tx, t);
        await inTx.get({ id: 'a' }); // takes the transaction's snapshot
        mustApply(await repo.update({ id: 'a' }, f(5), { balance: 5 })); // another session commits
        return inTx.update({ id: 'a' }, f(6), { balance: 6 });
      },
      { isolationLevel: 'repeatable read' },
    );
    const error = await attempt.then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(error).toBeInstanceOf(RetryableWriteError);
    expect(error).toMatchObject({ code: 'retryable', sqlState: '40001' });

    // Retried, the same write applies: fence 6 was never stale.
    expect((await repo.update({ id: 'a' }, f(6), { balance: 6 })).status).toBe('applied');
  });

  // Regression (found by an outside attack): inside a caller's REPEATABLE READ or SERIALIZABLE
  // transaction the floor check read the transaction's snapshot, which could not see a purge that
  // committed after it began, and a stale upsert re-created the purged row.
  for (const isolationLevel of ['repeatable read', 'serializable'] as const) {
    it(`${isolationLevel}: a stale upsert after a purge that committed since the snapshot is retryable, never applied`, async () => {
      const t = await createAccounts(db);
      const repo = fencedRepository(db, t);
      mustApply(await repo.upsert({ id: 'k', balance: 1 }, f(5)));
      mustApply(await repo.delete({ id: 'k' }, f(10)));
      const caller = postgres(test.url as string, { max: 1, onnotice: () => {} });
      try {
        const outcome = await drizzlePostgres(caller)
          .transaction(
            async (tx) => {
              await tx.execute(sql`select 1`); // the snapshot is taken here
              expect(await repo.purgeTombstones(new Date(Date.now() + 60_000))).toBe(1); // another connection
              return fencedRepository(tx as unknown as Database, t).upsert({ id: 'k', balance: 666 }, f(7));
            },
            { isolationLevel },
          )
          .catch((err: unknown) => err);
        expect(outcome).toBeInstanceOf(RetryableWriteError);
      } finally {
        await caller.end({ timeout: 5 });
      }
      expect(await storedRow(db, t, 'k')).toBeUndefined();
      // Retried, as a retryable error says: the serial outcome.
      expect(await repo.upsert({ id: 'k', balance: 666 }, f(7))).toEqual({ status: 'stale', currentFence: 10n });
    });
  }
});
