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
import { LeaseLostError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { claimLockRegister } from '../../src/repo/lock-scope.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { everyTransactionDriver, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

const lockNamed = (name: string) =>
  Object.freeze({ kind: 'test', source: 'ran-out', namespace: uniqueNamespace(), name });
type Lock = ReturnType<typeof lockNamed>;
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

describe.each(everyTransactionDriver)('a holder whose TTL ran out, on $name', ({ open }) => {
  let test: TestDatabase;
  let db: Database;
  let busy: ReturnType<typeof setInterval> | undefined;
  let row = 0;
  beforeAll(async () => {
    test = await open({ migrated: true });
    db = test.db;
    await migrate(db);
    await execute(
      db,
      sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
    );
    await execute(db, sql`insert into resource (id, value) select g, 'initial' from generate_series(1, 40) g`);
  }, 120_000);
  afterAll(async () => test?.close());
  beforeEach(() => {
    busy = setInterval(() => {
      const from = performance.now();
      while (performance.now() - from < 2) {}
    }, 1);
  });
  afterEach(() => clearInterval(busy));
  const valueAt = async (id: number) => (await execute(db, sql`select value from resource where id = ${id}`))[0]?.value;

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
});
