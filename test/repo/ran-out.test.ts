/**
 * A lock-scoped write by a holder whose TTL ran out by its own estimate while
 * its signal has not aborted yet — a process resumed after a pause writes
 * before its timers run (README, "Two scopes of fencing"). Its claim would
 * bound the transaction's idle time to the TTL left, 1 ms, and the server
 * would end the session before its next statement; instead the write is
 * `stale` where a higher fence claimed the lock, `LeaseLostError` where none
 * did, nothing is written, and the connection goes on — on every driver, a
 * single node-postgres `Client` too. The event loop is kept busy in 2 ms
 * slices meanwhile, as a resumed process's is.
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { FenceNotIssuedError, LeaseLostError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import type { LockIdentity } from '../../src/fencing/lock-identity.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { registerKey } from '../../src/repo/register-key.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { everyTransactionDriver, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { createResource, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { until, waitingForLock } from '../support/still-waiting.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

const lockNamed = (name: string) =>
  Object.freeze({ kind: 'test', source: 'ran-out', namespace: uniqueNamespace(), name });
type Lock = LockIdentity;
// A holder of `fence` whose estimate ran out a moment ago; its signal never aborts (its timers did not run).
const ranOut = (lock: Lock, fence: bigint) => ({
  fence: toFence(fence) as Fence,
  lock,
  expiresAt: performance.now() - 1,
  signal: new AbortController().signal,
});
const live = (lock: Lock, fence: bigint) => ({
  fence: toFence(fence) as Fence,
  lock,
  signal: new AbortController().signal,
});

describe.each(everyTransactionDriver.filter((d) => !d.real || needs('DATABASE_URL')))(
  'a holder whose TTL ran out, on $name',
  ({ open }) => {
    let test: TestDatabase;
    let db: Database;
    let busy: ReturnType<typeof setInterval> | undefined;
    let row = 0;
    beforeAll(async () => {
      test = await open({ migrated: true });
      db = test.db;
      await migrate(db);
      await createResource(db, 40);
    }, 120_000);
    afterAll(async () => test?.close());
    beforeEach(() => {
      busy = setInterval(() => {
        const from = performance.now();
        while (performance.now() - from < 2) {}
      }, 1);
    });
    afterEach(() => clearInterval(busy));
    const valueAt = async (id: number) =>
      (await execute(db, sql`select value from resource where id = ${id}`))[0]?.value;

    it('is stale with the higher fence where one claimed the lock, on every write, and writes nothing', async () => {
      const lock = lockNamed('claimed');
      expect(await claimLockRegister(db, live(lock, 42n))).toEqual({ status: 'claimed' });
      const repo = fencedRepository(db, resource).with(ranOut(lock, 41n));
      const ids = [++row, ++row, ++row, ++row];
      const [a, b, c, d] = ids as [number, number, number, number];
      const stale = { status: 'stale', currentFence: 42n };
      expect(await repo.update({ id: a }, { value: 'late' })).toEqual(stale);
      expect(await repo.upsert({ id: b, value: 'late' })).toEqual(stale);
      expect(await repo.delete({ id: c })).toEqual(stale);
      expect(await repo.modify({ id: d }, () => ({ value: 'late' }))).toEqual(stale);
      expect(await repo.updateWhere(sql`id = ${a}`, { value: 'late' })).toEqual({ applied: 0, stale: 1 });
      for (const id of ids) expect(await valueAt(id)).toBe('initial');
      // In a transaction of the caller's own, which goes on afterwards.
      const inside = await db.transaction(async (tx) => {
        const result = await fencedRepository(tx as unknown as Database, resource)
          .with(ranOut(lock, 41n))
          .update({ id: a }, { value: 'late' });
        const claimed = await claimLockRegister(tx as unknown as Database, ranOut(lock, 41n));
        const [after] = await execute(tx as unknown as Database, sql`select 1 as one`);
        return { result, claimed, after };
      });
      expect(inside).toEqual({ result: stale, claimed: stale, after: { one: 1 } });
    });

    it('a fenced transaction of such a lease is refused before any query, and its function never runs', async () => {
      const lock = lockNamed('fenced');
      let ran = false;
      const id = ++row;
      await expect(
        fencedTransaction(db, ranOut(lock, 41n), async (tx) => {
          ran = true;
          await execute(tx, sql`update resource set value = 'late' where id = ${id}`);
        }),
      ).rejects.toThrow(/TTL ran out before the transaction/);
      expect([ran, await valueAt(id)]).toEqual([false, 'initial']);
      // Nothing was claimed: the lock has no register row.
      const [register] = await execute(
        db,
        sql`select count(*)::int as n from palisade.lock_registers where lock_key = ${registerKey(lock)}::uuid`,
      );
      expect(register?.n).toBe(0);
    });

    it('fails with LeaseLostError where no higher fence claimed the lock, writes nothing, and the connection goes on', async () => {
      const lock = lockNamed('unclaimed');
      const repo = fencedRepository(db, resource).with(ranOut(lock, 41n));
      const [a, b] = [++row, ++row];
      await expect(repo.modify({ id: a }, () => ({ value: 'late' }))).rejects.toThrow(LeaseLostError);
      await expect(repo.upsert({ id: 1000 + b, value: 'late' })).rejects.toThrow(LeaseLostError);
      await expect(
        db.transaction(async (tx) =>
          fencedRepository(tx as unknown as Database, resource)
            .with(ranOut(lock, 41n))
            .update({ id: b }, { value: 'late' }),
        ),
      ).rejects.toThrow(LeaseLostError);
      expect([await valueAt(a), await valueAt(b), await valueAt(1000 + b)]).toEqual(['initial', 'initial', undefined]);
      // The same session serves the next holder (a single Client has no other).
      expect(
        await fencedRepository(db, resource).with(live(lock, 43n)).update({ id: a }, { value: 'next' }),
      ).toMatchObject({
        status: 'applied',
      });
    });

    it("a fence above the latest grant of a lock this database grants is FenceNotIssuedError, as a claim's would be", async () => {
      // A lock of this database's own Postgres leases, granted at 50 (the grant claims its register).
      const [{ id: source } = {}] = await execute(db, sql`select palisade.fence_source_id() as id`);
      const lock = Object.freeze({ kind: 'postgres', source: String(source), namespace: uniqueNamespace(), name: 'L' });
      await execute(db, sql`select palisade.register_grant('postgres', ${lock.namespace}, 'L', 50)`);
      const repo = fencedRepository(db, resource);
      const id = ++row;
      const forged = ranOut(lock, 51n);
      await expect(repo.with(forged).upsert({ id, value: 'forged' })).rejects.toMatchObject({
        code: 'fence_not_issued',
        registeredFence: 50n,
        attemptedFence: 51n,
      });
      await expect(repo.with(forged).modify({ id }, () => ({ value: 'forged' }))).rejects.toThrow(FenceNotIssuedError);
      // The latest grant's own holder, run out: LeaseLostError; an earlier one: stale.
      await expect(repo.with(ranOut(lock, 50n)).upsert({ id, value: 'late' })).rejects.toThrow(LeaseLostError);
      expect(await repo.with(ranOut(lock, 49n)).upsert({ id, value: 'late' })).toEqual({
        status: 'stale',
        currentFence: 50n,
      });
      expect(await valueAt(id)).toBe('initial');
    });
  },
);

describe.runIf(needs('DATABASE_URL'))(
  'a refused claim that waited for a raise (postgres.js)',
  { timeout: 60_000 },
  () => {
    // A claim that waits for a concurrent raise of the register keeps its share of the row after the
    // raise commits, though it is refused (Postgres keeps a row lock taken before its recheck fails): its
    // transaction stays bounded by the holder's TTL, so a holder paused there does not keep the next
    // raise waiting past it.
    let test: TestDatabase;
    beforeAll(async () => {
      test = await postgresDatabase({ max: 6, migrated: true });
      await execute(
        test.db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(
        test.db,
        sql`insert into resource (id, value) values (1, 'initial'), (2, 'initial'), (3, 'initial'), (4, 'initial')`,
      );
    }, 120_000);
    afterAll(async () => test?.close());

    const claims = {
      claimLockRegister: (tx: Database, a: ReturnType<typeof soon>) => claimLockRegister(tx, a),
      upsert: (tx: Database, a: ReturnType<typeof soon>) =>
        fencedRepository(tx, resource).with(a).upsert({ id: 1, value: 'late' }),
      updateWhere: (tx: Database, a: ReturnType<typeof soon>) =>
        fencedRepository(tx, resource).with(a).updateWhere(sql`id = 1`, { value: 'late' }),
    };
    const soon = (lock: Lock, fence: bigint) => ({ ...live(lock, fence), expiresAt: performance.now() + 1_500 });

    it.each((Object.keys(claims) as (keyof typeof claims)[]).map((how, i) => ({ how, row: 2 + i })))(
      '$how: refused, and its transaction still bounded',
      async ({ how, row }) => {
        const db = test.db;
        const lock = lockNamed(how);
        await claimLockRegister(db, live(lock, 41n));
        const a = soon(lock, 41n);
        // B raises the register in a transaction it keeps open until A's claim waits for it.
        let commitB: (() => void) | undefined;
        const b = db.transaction(async (tx) => {
          expect(await claimLockRegister(tx as unknown as Database, live(lock, 42n))).toEqual({ status: 'claimed' });
          await new Promise<void>((resolve) => {
            commitB = resolve;
          });
        });
        await until(() => commitB !== undefined);
        let resume = () => {};
        const seen: { pid?: number; result?: unknown; bound?: unknown } = {};
        // A's transaction is palisade's (a row-scoped modify's), whose connection closing is survived
        // ("When the connection closes inside a transaction"; one of your own would end the process).
        const aDone = fencedRepository(db, resource)
          .modify({ id: row }, toFence(1n) as Fence, async (_row, tx) => {
            seen.pid = Number((await execute(tx, sql`select pg_backend_pid() as pid`))[0]?.pid);
            seen.result = await claims[how](tx, a);
            seen.bound = (
              await execute(tx, sql`select current_setting('idle_in_transaction_session_timeout') as v`)
            )[0]?.v;
            await new Promise<void>((resolve) => {
              resume = resolve; // A "pauses" here, idle in its transaction
            });
            return { value: 'A' };
          })
          .catch(() => 'ended');
        await until(async () => seen.pid !== undefined && (await waitingForLock(db, seen.pid)));
        commitB?.();
        await b;
        await until(() => seen.bound !== undefined);
        expect(seen.result).toMatchObject(how === 'updateWhere' ? { applied: 0, stale: 1 } : { currentFence: 42n });
        expect(seen.bound).not.toBe('0');
        // C's claim goes through once A's session is ended by its bound.
        expect(await claimLockRegister(db, live(lock, 43n))).toEqual({ status: 'claimed' });
        resume();
        expect(await aDone).toBe('ended');
      },
    );
  },
);
