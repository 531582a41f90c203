/**
 * The register key (README, "Two scopes of fencing"): the key computed in
 * TypeScript is the one `palisade.lock_key` stores, for any lock; and the
 * two claim paths of a lock-scoped write — the full claim, then, once this
 * process saw a lease's claim hold, the register shared by its key alone —
 * decide alike when the register moved in between (a higher fence claimed
 * it, or an operator removed it); and a fenced transaction over several
 * locks tells their claims apart whatever the locks are named.
 */
import { fc, test as propTest } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { checkLockIdentity, type LockIdentity } from '../../src/fencing/lock-identity.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { registerKey, registerTag } from '../../src/repo/register-key.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { pgliteDatabase, type TestDatabase } from '../support/databases.js';
import { createScratchDatabase, type ScratchDatabase } from '../support/scratch-database.js';
import { needs, services } from '../support/services.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

// Any text a lock part may hold: no NUL, at most 1,024 UTF-8 bytes, any other code point (lone
// surrogates too: both ends send them as U+FFFD).
const part = (minLength: number) =>
  fc
    .string({ unit: 'binary', minLength, maxLength: 40 })
    .filter((s) => !s.includes('\u0000') && Buffer.byteLength(s) <= 1024);
const identityArb = fc.record({ kind: part(1), source: part(1), namespace: part(0), name: part(1) });
// Text drawn mostly from characters a driver or an encoding may change on the way: a byte-order mark
// (PGlite drops a leading one), U+FFFD, a combining accent, quotes, LIKE's wildcards. (No lone
// surrogates: checkLockIdentity refuses them.)
const trickyPart = (minLength: number) =>
  fc.oneof(
    part(minLength).filter((s) => !/[\uD800-\uDFFF]/u.test(s)),
    fc
      .array(fc.constantFrom('\uFEFF', '\uFFFD', 'e\u0301', '\u00E9', ' ', "'", '"', '%', '_', 'A'), {
        minLength: Math.max(minLength, 1),
        maxLength: 6,
      })
      .map((chars) => chars.join('')),
  );
const trickyIdentityArb = fc.record({
  kind: trickyPart(1),
  source: trickyPart(1),
  namespace: trickyPart(0),
  name: trickyPart(1),
});

// Any fence: the tag names it in decimal, up to the largest int8.
const fenceArb = fc.bigInt({ min: 1n, max: 2n ** 63n - 1n });

// Two or three locks of distinct keys, some claimed first at fence 1, 2 or 3 by other holders.
const claimedLocksArb = fc.uniqueArray(
  fc.record({ lock: trickyIdentityArb, claimed: fc.option(fc.integer({ min: 1, max: 3 })) }),
  { minLength: 2, maxLength: 3, selector: ({ lock }) => registerKey(lock) },
);

/**
 * Whatever the locks are named, a fenced transaction over them at fence 2 is
 * refused (nothing written) exactly when one was claimed at 3 — the claim's
 * rows must be matched to the leases however a driver reads their text back.
 * Needs a `ledger (round integer)` table.
 */
function refusedExactlyWhenClaimed(db: () => Database) {
  let round = 0;
  return async (locks: { lock: LockIdentity; claimed: number | null }[]) => {
    // Each round its own source: the registers of earlier rounds stay behind.
    const source = `round-${++round}`;
    const holders = locks.map(({ lock }) => ({
      fence: toFence(2n) as Fence,
      lock: Object.freeze({ ...lock, source: `${source}:${lock.source}` }),
      signal: AbortSignal.timeout(60_000),
    }));
    for (const [i, { claimed }] of locks.entries()) {
      const holder = holders[i] as (typeof holders)[number];
      if (claimed !== null) await claimLockRegister(db(), { ...holder, fence: toFence(BigInt(claimed)) as Fence });
    }
    const highest = locks.reduce((m, { claimed }) => Math.max(m, claimed ?? 0), 0);
    const result = await fencedTransaction(db(), holders, async (tx) => {
      await tx.execute(sql`insert into ledger (round) values (${round})`);
      return 'ran';
    });
    const [written] = await execute(db(), sql`select count(*)::int as n from ledger where round = ${round}`);
    if (highest > 2) {
      expect(result).toMatchObject({ status: 'stale', refusal: { table: null, currentFence: 3n } });
      expect(written?.n).toBe(0);
    } else {
      expect(result).toEqual({ status: 'applied', value: 'ran' });
      expect(written?.n).toBe(1);
    }
  };
}

async function sameKeyEverywhere(db: Database, lock: LockIdentity, fence: bigint) {
  const [row] = await execute(
    db,
    sql`insert into palisade.lock_registers (kind, source, namespace, name, fence)
      values (${lock.kind}, ${lock.source}, ${lock.namespace}, ${lock.name}, 1)
      on conflict do nothing
      returning lock_key::text as stored, palisade.lock_key(kind, source, namespace, name)::text as computed`,
  );
  // Two arbitrary locks equal after U+FFFD replacement land on one row: then only the function is asked.
  const [fn] = await execute(
    db,
    sql`select palisade.lock_key(${lock.kind}, ${lock.source}, ${lock.namespace}, ${lock.name})::text as computed`,
  );
  const key = registerKey(lock);
  expect(fn?.computed).toBe(key);
  if (row) expect([row.stored, row.computed]).toEqual([key, key]);
  // The tag a claim at `fence` takes is the one a raise above it looks for (migration 0010).
  const [tag] = await execute(
    db,
    sql`select t.k1, t.k2 from palisade.register_tag(${key}::uuid, ${String(fence)}::int8) t`,
  );
  expect([tag?.k1, tag?.k2]).toEqual([...registerTag(lock, fence)]);
}

describe('the register key', () => {
  let pglite: TestDatabase;
  beforeAll(async () => {
    pglite = await pgliteDatabase();
    await migrate(pglite.db);
    await execute(pglite.db, sql`create table ledger (round integer not null)`);
  }, 60_000);
  afterAll(async () => pglite?.close());

  propTest.prop([identityArb, fenceArb], { numRuns: 200 })(
    'is the one palisade.lock_key stores, and its tag the one palisade.register_tag computes (PGlite)',
    async (lock, fence) => {
      await sameKeyEverywhere(pglite.db, lock, fence);
    },
  );

  // PGlite reads some text back changed (a leading U+FEFF dropped).
  propTest.prop([claimedLocksArb], { numRuns: 60 })(
    'a fenced transaction over locks of any names is refused exactly when a higher fence claimed one (PGlite)',
    refusedExactlyWhenClaimed(() => pglite.db),
  );

  // A lock manager's live locks sit side by side in the key's index, however many other registers it holds.
  it('keeps one namespace’s registers together: its locks share the key’s first half, and only theirs do', () => {
    const key = (kind: string, source: string, namespace: string, name: string) =>
      registerKey(Object.freeze({ kind, source, namespace, name })).replaceAll('-', '');
    const a = key('redis', 's1', 'jobs', 'order:1');
    const b = key('redis', 's1', 'jobs', 'order:2');
    expect(a.slice(0, 16)).toBe(b.slice(0, 16));
    expect(a.slice(16)).not.toBe(b.slice(16));
    for (const other of [
      key('redis', 's1', 'jobs2', 'order:1'),
      key('redis', 's2', 'jobs', 'order:1'),
      key('etcd', 's1', 'jobs', 'order:1'),
      // The length prefixes: moving a byte between namespace and name is another namespace.
      key('redis', 's1', 'jobsorder:', '1'),
    ]) {
      expect(other.slice(0, 16)).not.toBe(a.slice(0, 16));
    }
  });

  it('tags a sharer by its fence: two fences of one lock, two tags; the first word is the register’s', () => {
    const lock = Object.freeze({ kind: 'k', source: 's', namespace: 'n', name: 'L' });
    const [a1, a2] = registerTag(lock, 41n);
    const [b1, b2] = registerTag(lock, 42n);
    expect(a1).toBe(b1);
    expect(a2).not.toBe(b2);
    expect(registerTag(lock, 41n)).toEqual([a1, a2]);
  });

  it('is taken from what checkLockIdentity checked: a getter that answers differently later changes nothing', () => {
    let reads = 0;
    const sly = Object.freeze({
      kind: 'k',
      source: 's',
      namespace: '',
      get name() {
        reads += 1;
        return reads === 1 ? 'first' : '\u0000bad';
      },
    });
    const checked = checkLockIdentity(sly);
    expect(checked.name).toBe('first');
    expect(checkLockIdentity(sly)).toBe(checked);
    expect(registerKey(checked)).toBe(registerKey({ kind: 'k', source: 's', namespace: '', name: 'first' }));
  });

  it('tells apart locks whose parts only split differently', () => {
    const a = registerKey({ kind: 'ab', source: 'c', namespace: '', name: 'd' });
    const b = registerKey({ kind: 'a', source: 'bc', namespace: '', name: 'd' });
    const c = registerKey({ kind: 'a', source: 'b', namespace: 'c', name: 'd' });
    expect(new Set([a, b, c]).size).toBe(3);
  });
});

describe.runIf(needs('DATABASE_URL'))('the two claim paths on Postgres', () => {
  let scratch: ScratchDatabase;
  let client: postgres.Sql;
  let db: Database;
  // The text of every statement sent, to tell which claim path a write took.
  const sent: string[] = [];

  beforeAll(async () => {
    scratch = await createScratchDatabase(services.postgres.url as string);
    client = postgres(scratch.url, {
      max: 4,
      onnotice: () => {},
      debug: (_connection, query) => {
        sent.push(query);
      },
    });
    db = drizzle(client) as unknown as Database;
    await migrate(db);
    await execute(
      db,
      sql`create table resource (id integer primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
    );
    await execute(db, sql`insert into resource (id, value) select g, 'initial' from generate_series(1, 20) g`);
    await execute(db, sql`create table ledger (round integer not null)`);
  }, 60_000);
  afterAll(async () => {
    await client?.end({ timeout: 5 });
    await scratch?.drop();
  });

  propTest.prop([identityArb, fenceArb], { numRuns: 100 })(
    'the key is the one palisade.lock_key stores, the tag the one palisade.register_tag computes',
    async (lock, fence) => {
      await sameKeyEverywhere(db, lock, fence);
    },
  );

  propTest.prop([claimedLocksArb], { numRuns: 30 })(
    'a fenced transaction over locks of any names is refused exactly when a higher fence claimed one',
    refusedExactlyWhenClaimed(() => db),
  );

  let n = 0;
  // A lease's lock identity: frozen, one object per lease (two leases of one lock in two processes
  // are two objects).
  const lockNamed = (name: string) => ({ kind: 'test', source: 'register-key', namespace: 'n', name });
  const lease = (fence: bigint, lock: ReturnType<typeof lockNamed>) => ({
    fence: toFence(fence) as Fence,
    lock: Object.freeze({ ...lock }),
    signal: new AbortController().signal,
  });
  // Which claim path the statement of one write took.
  async function pathOf<R>(write: () => Promise<R>): Promise<{ result: R; path: 'claim' | 'shared' | 'none' }> {
    const from = sent.length;
    const result = await write();
    const first = sent.slice(from).find((q) => q.startsWith('update "resource"')) ?? '';
    const path = first.includes('palisade.claim_lock(') ? 'claim' : first.includes('lock_key =') ? 'shared' : 'none';
    return { result, path };
  }
  const row = () => ({ id: ++n });

  it('a lease writes through the full claim first, then shares the register by its key', async () => {
    const repo = fencedRepository(db, resource);
    const a = lease(41n, lockNamed('first-then-shared'));
    const first = await pathOf(() => repo.with(a).update(row(), { value: 'a1' }));
    const second = await pathOf(() => repo.with(a).update(row(), { value: 'a2' }));
    expect([first.result.status, first.path]).toEqual(['applied', 'claim']);
    expect([second.result.status, second.path]).toEqual(['applied', 'shared']);
  });

  it('a higher fence claims between two writes of a lease: the shared write is refused, on a row it never wrote', async () => {
    const repo = fencedRepository(db, resource);
    const lock = lockNamed('raised-between');
    const a = lease(41n, lock);
    const b = lease(42n, lock);
    await repo.with(a).update(row(), { value: 'a1' });
    expect((await repo.with(b).update(row(), { value: 'b1' })).status).toBe('applied');
    const late = await pathOf(() => repo.with(a).update(row(), { value: 'a2' }));
    expect(late.path).toBe('shared');
    expect(late.result).toEqual({ status: 'stale', currentFence: 42n });
  });

  it('an operator removed the register: the next shared write claims it again and applies', async () => {
    const repo = fencedRepository(db, resource);
    const lock = lockNamed('removed');
    const a = lease(41n, lock);
    await repo.with(a).update(row(), { value: 'a1' });
    await execute(db, sql`delete from palisade.lock_registers where lock_key = ${registerKey(lock)}::uuid`);
    const again = await pathOf(() => repo.with(a).update(row(), { value: 'a2' }));
    expect([again.result.status, again.path]).toEqual(['applied', 'shared']);
    const [register] = await execute(
      db,
      sql`select fence::text as fence from palisade.lock_registers where lock_key = ${registerKey(lock)}::uuid`,
    );
    expect(register?.fence).toBe('41');
  });

  it('a lock given as a fresh object literal on every call always takes the full claim', async () => {
    const repo = fencedRepository(db, resource);
    const lock = lockNamed('open-literal');
    const open = () => ({ fence: toFence(41n) as Fence, lock: { ...lock }, signal: AbortSignal.timeout(60_000) });
    const paths = [];
    for (const value of ['a1', 'a2', 'a3']) {
      const { result, path } = await pathOf(() => repo.with(open()).update(row(), { value }));
      paths.push([result.status, path]);
    }
    expect(paths).toEqual([
      ['applied', 'claim'],
      ['applied', 'claim'],
      ['applied', 'claim'],
    ]);
  });

  it("an eager claim (claimLockRegister) puts the lease's first write on the shared path", async () => {
    const repo = fencedRepository(db, resource);
    const a = lease(41n, lockNamed('eager'));
    expect(await claimLockRegister(db, a)).toEqual({ status: 'claimed' });
    const first = await pathOf(() => repo.with(a).update(row(), { value: 'a1' }));
    expect([first.result.status, first.path]).toEqual(['applied', 'shared']);
  });

  it('one lock identity object at another fence takes the full claim', async () => {
    const repo = fencedRepository(db, resource);
    const identity = Object.freeze(lockNamed('reused-identity'));
    const at = (fence: bigint) => ({
      fence: toFence(fence) as Fence,
      lock: identity,
      signal: AbortSignal.timeout(60_000),
    });
    await repo.with(at(41n)).update(row(), { value: 'a1' });
    const next = await pathOf(() => repo.with(at(43n)).update(row(), { value: 'b1' }));
    expect([next.result.status, next.path]).toEqual(['applied', 'claim']);
    const old = await pathOf(() => repo.with(at(41n)).update(row(), { value: 'a2' }));
    expect(old.result).toEqual({ status: 'stale', currentFence: 43n });
  });
});
