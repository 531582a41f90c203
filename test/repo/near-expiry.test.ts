/**
 * A lock-scoped write or fenced transaction whose holder has a few
 * milliseconds of TTL left (README, "Two scopes of fencing"): palisade
 * bounds the transaction's idle time to them, and when the process is
 * slower than that — a function that runs longer, a busy event loop — the
 * server ends the session. The call then rejects with `LeaseLostError` (the
 * driver's failure as its cause), never a bare `DatabaseError`, and nothing
 * it wrote is visible. On every driver with a server: postgres.js, a
 * node-postgres pool and a single node-postgres `Client` (whose connection
 * is gone afterwards; README, "Installing"). Rows are read back through a
 * connection of their own: a postgres.js pool may hand the ended session to
 * the next query once more (README, "When the connection closes inside a
 * transaction").
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, LeaseLostError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { everyTransactionDriver, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

// A holder of a lock no other test uses, with `ms` of TTL left by its estimate; its signal never aborts.
const holder = (ms: number) => ({
  fence: toFence(7n) as Fence,
  lock: Object.freeze({ kind: 'test', source: 'near-expiry', namespace: uniqueNamespace(), name: 'L' }),
  expiresAt: performance.now() + ms,
  signal: new AbortController().signal,
});
// Longer than any bound here: the server ends a session idle for its bound whatever the client does.
const OUTLAST_MS = 150;
const TTL_LEFT_MS = 30;

/** What a call settled with: the result, or the error. */
async function settled<T>(call: () => Promise<T>): Promise<{ ok: T } | { err: unknown }> {
  try {
    return { ok: await call() };
  } catch (err) {
    return { err };
  }
}

function expectOutlived(outcome: { ok: unknown } | { err: unknown }): void {
  expect(outcome).toHaveProperty('err');
  const { err } = outcome as { err: unknown };
  expect(err).toBeInstanceOf(LeaseLostError);
  expect(err).not.toBeInstanceOf(DatabaseError);
}

describe.runIf(needs('DATABASE_URL')).each(everyTransactionDriver.filter((d) => d.real))(
  'a holder whose TTL runs out inside its transaction, on $name',
  ({ open }) => {
    // A database per call: a single Client's connection does not come back once its session was ended.
    const opened: TestDatabase[] = [];
    let reader: postgres.Sql | undefined;
    let row = 0;
    beforeAll(() => {
      row = 0;
    });
    afterAll(async () => {
      await reader?.end({ timeout: 1 });
      await Promise.all(opened.map((t) => t.close()));
    });
    async function fresh(): Promise<{ db: Database; valueAt: (id: number) => Promise<unknown> }> {
      const t = await open({ migrated: true });
      opened.push(t);
      await migrate(t.db);
      await execute(
        t.db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(t.db, sql`insert into resource (id, value) select g, 'initial' from generate_series(1, 20) g`);
      const own = postgres(t.url as string, { max: 1, onnotice: () => {} });
      const read = drizzle(own) as unknown as Database;
      await reader?.end({ timeout: 1 });
      reader = own;
      return {
        db: t.db,
        valueAt: async (id) => (await execute(read, sql`select value from resource where id = ${id}`))[0]?.value,
      };
    }

    it('a lock-scoped modify whose function outlasts the TTL left: LeaseLostError, and the patch is not written', async () => {
      const { db, valueAt } = await fresh();
      const id = ++row;
      const outcome = await settled(() =>
        fencedRepository(db, resource)
          .with(holder(TTL_LEFT_MS))
          .modify({ id }, async () => {
            await sleep(OUTLAST_MS);
            return { value: 'late' };
          }),
      );
      expectOutlived(outcome);
      expect(await valueAt(id)).toBe('initial');
    });

    it('a fenced transaction whose function outlasts the TTL left: LeaseLostError, and nothing it wrote is visible', async () => {
      const { db, valueAt } = await fresh();
      const [a, b] = [++row, ++row];
      const repo = fencedRepository(db, resource);
      const lease = holder(TTL_LEFT_MS);
      const outcome = await settled(() =>
        fencedTransaction(db, lease, async () => {
          await repo.with(lease).update({ id: a }, { value: 'early' });
          await sleep(OUTLAST_MS);
          // The session is gone: this statement is what hears it.
          await repo.with(lease).update({ id: b }, { value: 'late' });
        }),
      );
      expectOutlived(outcome);
      expect([await valueAt(a), await valueAt(b)]).toEqual(['initial', 'initial']);
    });

    it('in a transaction opened for something else: the write after the bound ended the session is LeaseLostError', async () => {
      const { db, valueAt } = await fresh();
      const [a, b, c] = [++row, ++row, ++row];
      const lease = holder(TTL_LEFT_MS);
      let second: { ok: unknown } | { err: unknown } = { ok: 'not reached' };
      let fnDone = () => {};
      const done = new Promise<void>((resolve) => {
        fnDone = resolve;
      });
      // A row-scoped modify's transaction: palisade's, whose connection closing the process survives on every
      // driver ("When the connection closes inside a transaction"; one of your own on postgres.js would end it).
      const outer = await settled(() =>
        fencedRepository(db, resource).modify({ id: c }, toFence(1n) as Fence, async (_row, tx) => {
          const repo = fencedRepository(tx, resource).with(lease);
          // Bounds the transaction to the TTL left, then writes.
          await repo.update({ id: a }, { value: 'early' });
          await sleep(OUTLAST_MS);
          second = await settled(() => repo.update({ id: b }, { value: 'late' }));
          fnDone();
          return { value: 'outer' };
        }),
      );
      // On postgres.js the outer call rejects as soon as the close is seen, while the function still sleeps.
      await done;
      expectOutlived(second);
      expect(outer).toHaveProperty('err');
      expect([await valueAt(a), await valueAt(b), await valueAt(c)]).toEqual(['initial', 'initial', 'initial']);
    });

    it('with the event loop busy in 3 ms slices and 4 ms left, every write is applied or LeaseLostError, never a DatabaseError', async () => {
      type Call = (db: Database, id: number) => Promise<unknown>;
      const calls: Call[] = [
        (db, id) =>
          fencedRepository(db, resource)
            .with(holder(4))
            .modify({ id }, () => ({ value: 'late' })),
        (db, id) => fencedRepository(db, resource).with(holder(4)).upsert({ id, value: 'late' }),
        (db, id) =>
          fencedTransaction(db, holder(4), () =>
            fencedRepository(db, resource).update({ id }, 7n as Fence, { value: 'late' }),
          ),
      ];
      const outcomes: string[] = [];
      for (const call of [...calls, ...calls]) {
        // A database each: a single Client whose session ended answers nothing more.
        const { db, valueAt } = await fresh();
        const id = ++row;
        const busy = setInterval(() => {
          const from = performance.now();
          while (performance.now() - from < 3) {}
        }, 1);
        let outcome: { ok: unknown } | { err: unknown };
        try {
          outcome = await settled(() => call(db, id));
        } finally {
          clearInterval(busy);
        }
        const value = await valueAt(id);
        if ('ok' in outcome) {
          outcomes.push('applied');
          expect(value).toBe('late');
        } else {
          outcomes.push((outcome.err as Error).name);
          expect(outcome.err).toBeInstanceOf(LeaseLostError);
          expect(value).toBe('initial');
        }
      }
      expect(outcomes).toHaveLength(6);
    });
  },
);
