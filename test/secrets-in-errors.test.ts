/**
 * No error palisade throws carries a row value or a query parameter. A
 * secret (a card PIN, a customer's e-mail) goes through every repository
 * method in a place where the server refuses it — a mistyped value
 * (`invalid input syntax for type integer: "…"` quotes it), a check
 * constraint (its DETAIL is the failing row), a condition — and through the
 * lock managers as a lock name and a holder label. Each call must throw a
 * `PalisadeError` with a `code`, and the secret must appear nowhere: not in
 * `String(err)`, `err.message` or `err.stack`, nor anywhere in the cause
 * chain, nor in `util.inspect(err)` (what `console.log` and most loggers
 * print). The policy: messages keep the SQLSTATE, its condition name, and
 * the table, column and constraint the server names; the driver's own
 * error is replaced by a sanitised cause with those fields only.
 *
 * On PGlite always and on the real Postgres when DATABASE_URL is set.
 */
import { inspect } from 'node:util';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { PalisadeError } from '../src/errors.js';
import { advisoryLockManager } from '../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../src/fencing/backends/postgres-lease/backend.js';
import { toFence } from '../src/fencing/fence.js';
import type { LockManager } from '../src/fencing/lock-manager.js';
import { migrate } from '../src/migrate.js';
import { type FencedRepository, fencedRepository } from '../src/repo/repository.js';
import { fenceColumns } from '../src/schema/fence-columns.js';
import { drivers, type TestDatabase } from './support/databases.js';

const SECRET = 'SECRET-PIN-4111';

const vault = pgTable('secret_vault', {
  id: integer('id').primaryKey(),
  pin: integer('pin').notNull().default(0),
  note: text('note'),
  ...fenceColumns(),
});

/** Runs `call`, which must fail, and returns its error. */
async function failure(call: () => unknown): Promise<unknown> {
  try {
    await call();
  } catch (err) {
    return err;
  }
  throw new Error('the call did not fail');
}

/**
 * A PalisadeError with a code, and the secret nowhere in its message, string,
 * stack or causes. `properties`: nor in any property (repository errors);
 * lock errors do hand the caller's own lock name back as `lockName`.
 */
function expectCleanOf(err: unknown, { properties = true } = {}, secret = SECRET): void {
  expect(err).toBeInstanceOf(PalisadeError);
  expect(typeof (err as PalisadeError).code).toBe('string');
  if (properties) expect(inspect(err, { depth: 10, showHidden: true })).not.toContain(secret);
  else expect(inspect((err as Error).cause, { depth: 10, showHidden: true })).not.toContain(secret);
  for (let e: unknown = err, depth = 0; e && depth < 10; e = (e as { cause?: unknown }).cause, depth++) {
    expect(String(e)).not.toContain(secret);
    if (e instanceof Error) {
      expect(e.message).not.toContain(secret);
      expect(e.stack ?? '').not.toContain(secret);
    }
    if (properties || depth > 0) {
      expect(JSON.stringify(e, (_k, v) => (typeof v === 'bigint' ? String(v) : v)) ?? '').not.toContain(secret);
    }
  }
}

describe.each(drivers)('secrets stay out of errors on $name', ({ name, open }) => {
  let test: TestDatabase;
  let repo: FencedRepository<typeof vault>;
  const F = (n: bigint) => toFence(n);

  beforeAll(async () => {
    test = await open();
    await migrate(test.db);
    await test.db.execute(sql`create table secret_vault (
      id integer primary key, pin integer not null default 0, note text check (length(note) < 5),
      last_fence bigint not null default 0, deleted_at timestamptz)`);
    await test.db.execute(sql`insert into secret_vault (id, pin, last_fence) values (1, 1234, 5)`);
    repo = fencedRepository(test.db, vault);
  });
  afterAll(async () => {
    await test?.close();
  });

  const s = SECRET as unknown as number; // a string where an integer is due: the server quotes it back
  const calls: [string, () => unknown][] = [
    ['get with a mistyped key', () => repo.get({ id: s })],
    ['find with a secret in the condition', () => repo.find(sql`${vault.id} = ${SECRET}`)],
    ['update with a mistyped value', () => repo.update({ id: 1 }, F(10n), { pin: s })],
    ['update with a mistyped key', () => repo.update({ id: s }, F(10n), { pin: 1 })],
    [
      'update breaking a check constraint (DETAIL: the failing row)',
      () => repo.update({ id: 1 }, F(10n), { note: SECRET }),
    ],
    ['upsert with a mistyped value', () => repo.upsert({ id: 2, pin: s }, F(10n))],
    ['upsert breaking a check constraint', () => repo.upsert({ id: 3, pin: 1, note: SECRET }, F(10n))],
    ['delete with a mistyped key', () => repo.delete({ id: s }, F(10n))],
    ['modify returning a mistyped value', () => repo.modify({ id: 1 }, F(10n), () => ({ pin: s }))],
    ['modify with a mistyped key', () => repo.modify({ id: s }, F(10n), () => ({ pin: 1 }))],
    [
      'updateWhere with a secret in the condition',
      () => repo.updateWhere(sql`${vault.id} = ${SECRET}`, F(10n), { pin: 1 }),
    ],
    ['updateWhere with a mistyped value', () => repo.updateWhere(sql`true`, F(10n), { pin: s })],
    [
      'with(lease).upsert with a mistyped value',
      () => repo.with({ fence: F(10n), signal: new AbortController().signal }).upsert({ id: 2, pin: s }),
    ],
  ];

  it.each(calls)('%s: a PalisadeError with a code, and no secret', async (_label, call) => {
    const err = await failure(call);
    expectCleanOf(err);
    // What the message keeps: the SQLSTATE (and, where the server names them, table and constraint).
    expect((err as Error).message).toMatch(/SQLSTATE [0-9A-Z]{5}/);
  });

  it('a constraint violation still names the constraint and the table', async () => {
    const err = await failure(() => repo.update({ id: 1 }, F(10n), { note: SECRET }));
    expect((err as Error).message).toContain('secret_vault_note_check');
    expect((err as Error).message).toContain('secret_vault');
    expect(err).toMatchObject({ code: 'database', sqlState: '23514', constraint: 'secret_vault_note_check' });
  });

  it('nothing of the above was written', async () => {
    expect(await repo.find()).toEqual([
      expect.objectContaining({ id: 1, pin: 1234, note: null, lastFence: 5n, deletedAt: null }),
    ]);
  });

  describe('lock managers', () => {
    const managers: [string, () => LockManager][] = [
      ['postgres leases', () => postgresLockManager({ client: test.db, namespace: 'secrets', listen: false })],
      ...(name === 'postgres'
        ? [
            [
              'postgres advisory',
              () =>
                advisoryLockManager({
                  client: (test.db as unknown as { $client: Parameters<typeof advisoryLockManager>[0]['client'] })
                    .$client,
                  namespace: 'secrets',
                }),
            ] as [string, () => LockManager],
          ]
        : []),
    ];

    it.each(managers)('%s: a secret lock name and holder label stay out of every error', async (_label, make) => {
      const locks = make();
      const expectClean = (err: unknown) => expectCleanOf(err, { properties: false });
      const lockName = `account:${SECRET}`;
      const holder = `worker ${SECRET}`;
      try {
        const lease = await locks.acquire(lockName, { ttlMs: 10_000, holder });
        // Held: a second acquire gives up (LockUnavailableError) — its message must not name the lock.
        expectClean(await failure(() => locks.acquire(lockName, { ttlMs: 10_000, waitMs: 0 })));
        expectClean(await failure(() => locks.acquire(lockName, { ttlMs: 10_000, waitMs: 60 })));
        expectClean(await failure(() => locks.acquireAll(['a', lockName], { ttlMs: 10_000, waitMs: 0, holder })));
        expect(await lease.release()).toBe('released');
        // Released: the lease's signal reason and a late extend (LeaseLostError).
        expectClean(lease.signal.reason);
        expectClean(await failure(() => lease.extend()));
        // Bad input carrying the secret: refused without repeating it.
        expectClean(await failure(() => locks.acquire(lockName, { ttlMs: 10_000, holder: `${holder}\u0000` })));
        expectClean(await failure(() => locks.acquire(`${lockName}\u0000`, { ttlMs: 10_000 })));
        expectClean(await failure(() => locks.acquire(lockName, { ttlMs: 10_000, holder: holder.repeat(30) })));
        expectClean(await failure(() => locks.acquire(`${SECRET}${'x'.repeat(1100)}`, { ttlMs: 10_000 })));
      } finally {
        await locks.close();
      }
    });
  });
});
