/**
 * How a user proves their own repository is fenced, in a few lines of
 * vitest, with `assertStaleWriteRefused` from `palisade-db/testing`: embedded
 * PGlite and the Postgres lease lock manager, no server needed.
 *
 * The first test is the one to copy into your project (imports there:
 * `palisade` and `palisade-db/testing`). The second shows the helper failing
 * on a write path that ignores the fence, so a green first test means
 * something.
 */
import type { PGlite } from '@electric-sql/pglite';
import { eq, sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/pglite';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Database } from '../../src/driver.js';
import type { Fence } from '../../src/fencing/fence.js';
import { fenceColumns, fencedRepository, migrate, postgresLockManager } from '../../src/index.js';
import { assertStaleWriteRefused } from '../../src/testing/index.js';
import { newPglite } from '../support/pglite.js';

const accounts = pgTable('accounts', {
  id: text('id').primaryKey(),
  balance: integer('balance').notNull(),
  ...fenceColumns(),
});

describe('assertStaleWriteRefused on PGlite with the Postgres lease lock manager', () => {
  let client: PGlite;
  let db: Database;

  beforeAll(async () => {
    client = newPglite();
    db = drizzle(client) as unknown as Database;
    await migrate(db);
    await db.execute(sql`create table accounts (
      id text primary key, balance integer not null, last_fence bigint not null default 0, deleted_at timestamptz)`);
    await db.insert(accounts).values({ id: 'acct-1', balance: 100 });
  });
  afterAll(async () => {
    await client?.close();
  });

  it('my repository refuses a paused holder’s late write', async () => {
    const locks = postgresLockManager({ client: db, namespace: 'my-app-tests' });
    const repo = fencedRepository(db, accounts);

    const outcome = await assertStaleWriteRefused({
      manager: locks,
      lock: 'account:acct-1',
      ttlMs: 200,
      write: (fence, holder) =>
        repo.modify({ id: 'acct-1' }, fence, (row) => ({ balance: row.balance + (holder === 'second' ? 10 : 1_000) })),
    });

    expect(outcome.late).toEqual({ status: 'stale', currentFence: outcome.secondFence });
    // Only the second holder's +10 landed; the paused holder's +1000 did not.
    expect(await repo.get({ id: 'acct-1' })).toMatchObject({ balance: 110, lastFence: outcome.secondFence });
    await locks.close();
  });

  it('fails loudly for a write path that ignores the fence', async () => {
    const locks = postgresLockManager({ client: db, namespace: 'my-app-tests-unfenced' });
    // A plain drizzle update: holds the lock, never checks the fence. Reported as "applied" every time.
    const unfenced = async () => {
      const [row] = await db
        .update(accounts)
        .set({ balance: sql`${accounts.balance} + 1` })
        .where(eq(accounts.id, 'acct-1'))
        .returning();
      return { status: 'applied' as const, row };
    };

    await expect(
      assertStaleWriteRefused({ manager: locks, lock: 'account:acct-1', ttlMs: 200, write: unfenced }),
    ).rejects.toThrow(/late write was not refused as stale: applied — is the write fenced\?/);
    await locks.close();
  });

  it('with read, fails for a write path that writes something unfenced before its fenced write', async () => {
    const locks = postgresLockManager({ client: db, namespace: 'my-app-tests-half-fenced' });
    const repo = fencedRepository(db, accounts);
    // An unfenced bump, then the fenced modify: the late holder's result says "stale", its bump landed.
    const halfFenced = async (fence: Fence) => {
      await db
        .update(accounts)
        .set({ balance: sql`${accounts.balance} + 1` })
        .where(eq(accounts.id, 'acct-1'));
      return repo.modify({ id: 'acct-1' }, fence, (row) => ({ balance: row.balance + 10 }));
    };
    const read = () => repo.get({ id: 'acct-1' });

    const withoutRead = await assertStaleWriteRefused({
      manager: locks,
      lock: 'account:half',
      ttlMs: 200,
      write: halfFenced,
    });
    expect(withoutRead.late.status).toBe('stale'); // the reported result alone cannot tell
    await expect(
      assertStaleWriteRefused({ manager: locks, lock: 'account:half', ttlMs: 200, write: halfFenced, read }),
    ).rejects.toThrow(/reported stale but changed what read\(\) returns/);
    await locks.close();
  });
});
