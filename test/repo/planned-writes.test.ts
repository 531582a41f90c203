/**
 * An update of a shape its table has written before takes the plan of that
 * shape (src/repo/update-plan.ts) and builds no statement. It must still
 * read the caller's key and patch once, refuse what every write refuses,
 * and decide as any other write. Each case here was a divergence found by
 * attacking the planned path (test/property/update-plan.prop.test.ts
 * searches for more).
 */
import { sql } from 'drizzle-orm';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Database } from '../../src/driver.js';
import { InvalidArgumentError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { drivers, type TestDatabase } from '../support/databases.js';
import { createAccounts } from './fixtures.js';

const f = (n: number): Fence => toFence(n);

describe.each(drivers)('planned writes on $name', ({ open }) => {
  let test: TestDatabase;
  let db: Database;

  beforeAll(async () => {
    test = await open();
    db = test.db;
    await migrate(db);
  });
  afterAll(async () => {
    await test?.close();
  });

  /** Accounts `a` and `b`, and a repository whose table has written the shape `{ owner }` once. */
  async function planned() {
    const t = await createAccounts(db);
    await db.execute(sql`insert into ${t} (id, owner) values ('a', 'ann'), ('b', 'bob'), ('c', 'cy')`);
    const repo = fencedRepository(db, t);
    expect((await repo.update({ id: 'c' }, f(1), { owner: 'first' })).status).toBe('applied');
    const owners = async () =>
      Object.fromEntries((await repo.find()).map((r) => [r.id, `${r.owner}@${r.lastFence}`] as const));
    return { t, repo, owners };
  }

  it('a key is read once, also when the patch takes the full path: the write lands on the row it named', async () => {
    const { t, repo, owners } = await planned();
    const patches = [
      { owner: 'sql', balance: sql`${t.balance} + 1` },
      { owner: 'undefined', balance: undefined },
    ];
    for (const [i, patch] of patches.entries()) {
      let reads = 0;
      const key = {
        get id() {
          reads++;
          return reads === 1 ? 'a' : 'b';
        },
      };
      expect((await repo.update(key, f(2 + i), patch as never)).status).toBe('applied');
      expect(reads).toBe(1);
    }
    const now = await owners();
    expect(now.a).toBe('undefined@3');
    expect(now.b).toBe('bob@0');
  });

  it('a patch value is read once, planned or not', async () => {
    const { repo, owners } = await planned();
    let reads = 0;
    const patch = {
      get owner() {
        reads++;
        return `read ${reads}`;
      },
    };
    expect((await repo.update({ id: 'a' }, f(2), patch)).status).toBe('applied'); // the shape `{ owner }`: planned
    expect((await repo.update({ id: 'b' }, f(2), { ...patch, balance: undefined })).status).toBe('applied');
    expect(reads).toBe(2);
    expect(await owners()).toMatchObject({ a: 'read 1@2', b: 'read 2@2' });
  });

  it('what a write refuses it refuses once the shape is planned: an array as the patch, a bad name before a value is looked at', async () => {
    const { repo, owners } = await planned();
    const arrayPatch = Object.setPrototypeOf(Object.assign([], { owner: 'from an array' }), Object.prototype);
    await expect(repo.update({ id: 'a' }, f(2), arrayPatch)).rejects.toThrow(InvalidArgumentError);
    // A value whose inspection throws (a revoked proxy) does not hide the refusal of a name.
    const revoked = () => {
      const r = Proxy.revocable({}, {});
      r.revoke();
      return r.proxy;
    };
    for (const [patch, message] of [
      [{ owner: revoked(), lastFence: 9n }, /may not set lastFence/],
      [{ owner: revoked(), nope: 1 }, /has no column nope/],
      [{ owner: revoked(), id: 'z' }, /may not change key column id/],
    ] as const) {
      await expect(repo.update({ id: 'a' }, f(2), patch as never)).rejects.toThrow(message);
    }
    expect((await owners()).a).toBe('ann@0');
  });
});
