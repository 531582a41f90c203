/**
 * Bad input over the public API, table by table: fences, TTLs and other
 * acquire options, lock names, patches, keys, and table identifiers that
 * need quoting. Each bad value must be refused with a typed error carrying a
 * `code` (`invalid_argument`), before anything is sent or written: the
 * repository sends no query and the row is unchanged; a lock manager leaves
 * its backend exactly as it was (no lease row, no advisory lock, no fence
 * drawn, no Redis key) — and no lock is ever left without an expiry.
 *
 * What the valid-but-surprising inputs do:
 * - Lock names are normalised to Unicode NFC: "café" typed composed
 *   (U+00E9) and decomposed (e + U+0301) is ONE lock.
 * - `{`, `}` and `:` are ordinary characters in a lock name: `{x}`, `a:b`,
 *   `lock:x` or `{palisade:<ns>}:fence` are locks of their own and collide
 *   neither with each other nor with the backend's own keys (the Redis
 *   fence counter keeps counting).
 * - A table or column whose name contains `"` works: identifiers are quoted.
 *
 * Repository tables run on PGlite always and the real Postgres when
 * DATABASE_URL is set; lock managers on every backend available (the
 * Postgres lease backend on PGlite always; Postgres leases, advisory locks,
 * Redis and etcd when their service or binary is there).
 */
import { randomBytes } from 'node:crypto';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import { Etcd3 } from 'etcd3';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { type Database, execute } from '../src/driver.js';
import { InvalidArgumentError, PalisadeError } from '../src/errors.js';
import { postgresLockManager } from '../src/fencing/backends/postgres-lease/backend.js';
import { redisLockManager } from '../src/fencing/backends/redis/manager.js';
import { type Fence, MAX_FENCE, toFence } from '../src/fencing/fence.js';
import type { LockManager } from '../src/fencing/lock-manager.js';
import { MAX_TTL_MS } from '../src/fencing/options.js';
import { migrate } from '../src/migrate.js';
import { type FencedRepository, fencedRepository } from '../src/repo/repository.js';
import { fenceColumns } from '../src/schema/fence-columns.js';
import { withQueryLog } from './repo/fixtures.js';
import { drivers, postgresDatabase, type TestDatabase } from './support/databases.js';
import { type EtcdCluster, startEtcdCluster } from './support/etcd-cluster.js';
import { type BackendKind, openManager } from './support/managers.js';
import { newPglite } from './support/pglite.js';
import { needs } from './support/services.js';

/**
 * The file's one PGlite (each takes a second and hundreds of MB to start), opened at first use and closed after the
 * last test: the repository tables (their own tables), the lease backend on PGlite (a namespace of its own) and the
 * constructor checks share it. Its `close()` for a suite leaves it open.
 */
let lite: ReturnType<typeof newPglite> | undefined;
function filePglite(): ReturnType<typeof newPglite> {
  lite ??= newPglite();
  return lite;
}
afterAll(async () => {
  await lite?.close();
});

/** The file's PGlite as a test database, for the suites that run on every driver. */
async function filePgliteDatabase(): Promise<TestDatabase> {
  return { driver: 'pglite', db: drizzlePglite(filePglite()) as unknown as Database, close: async () => {} };
}

/** Runs `call` and returns what it threw (synchronously or as a rejection), or `undefined`. */
async function thrown(call: () => unknown): Promise<unknown> {
  try {
    await call();
    return undefined;
  } catch (err) {
    return err;
  }
}

/** What `make` threw at once (a constructor's refusal), or `undefined`: a rejection later does not count. */
function thrownAtOnce(make: () => unknown): unknown {
  try {
    make();
    return undefined;
  } catch (err) {
    return err;
  }
}

/** The refusal every bad input must get: an InvalidArgumentError with code `invalid_argument`. */
function expectInvalid(err: unknown): void {
  expect(err).toBeInstanceOf(InvalidArgumentError);
  expect(err).toBeInstanceOf(PalisadeError);
  expect((err as PalisadeError).code).toBe('invalid_argument');
}

// ─── fences ────────────────────────────────────────────────────────────────

/** Refused by `toFence` and by every write. */
const BAD_FENCES: [string, unknown][] = [
  ['0', 0],
  ['-1', -1],
  ['1.5', 1.5],
  ['NaN', Number.NaN],
  ['Infinity', Number.POSITIVE_INFINITY],
  ['-Infinity', Number.NEGATIVE_INFINITY],
  ['2^53+1 as a number (already rounded)', 2 ** 53 + 1],
  ['2^63 as a number', 2 ** 63],
  ['2^63 as a bigint (above int8)', 2n ** 63n],
  ['0n', 0n],
  ['-1n', -1n],
  ["' 5'", ' 5'],
  ["'5 '", '5 '],
  ["'0x10'", '0x10'],
  ["'1e3'", '1e3'],
  ["'05'", '05'],
  ["'+5'", '+5'],
  ["''", ''],
  ["'9223372036854775808' (2^63)", '9223372036854775808'],
  ['{}', {}],
  ['[]', []],
  ['[5]', [5]],
  ['{ valueOf: () => 5n }', { valueOf: () => 5n }],
  ['null', null],
  ['undefined', undefined],
  ['true', true],
  ['a symbol', Symbol('5')],
];

/** Accepted by `toFence` (it converts), but not where a `Fence` is due: a write takes a bigint only. */
const CONVERTIBLE: [string, unknown, bigint][] = [
  ['5 (a safe number)', 5, 5n],
  ["'5' (a canonical decimal)", '5', 5n],
  ['2^53 − 1', Number.MAX_SAFE_INTEGER, 2n ** 53n - 1n],
  ["'9223372036854775807' (2^63 − 1)", '9223372036854775807', MAX_FENCE],
];

describe('toFence', () => {
  it.each(BAD_FENCES)('refuses %s with invalid_argument', async (_label, value) => {
    expectInvalid(await thrown(() => toFence(value)));
  });

  it.each(CONVERTIBLE)('accepts %s', (_label, value, want) => {
    expect(toFence(value)).toBe(want);
  });

  it('accepts 1n and 2^63 − 1, the ends of the range', () => {
    expect(toFence(1n)).toBe(1n);
    expect(toFence(MAX_FENCE)).toBe(MAX_FENCE);
  });
});

// ─── the repository ────────────────────────────────────────────────────────

const items = pgTable('bad_input_items', {
  id: text('id').primaryKey(),
  n: integer('n').notNull().default(0),
  ...fenceColumns(),
});

/** A table and a column whose names need quoting. */
const weird = pgTable('we"ird', {
  id: text('i"d').primaryKey(),
  val: text('va"l; drop table x'),
  ...fenceColumns(),
});

const F = (n: bigint) => toFence(n);

type Write = (repo: FencedRepository<typeof items>, fence: unknown) => Promise<unknown> | unknown;
const WRITES: [string, Write][] = [
  ['update', (r, f) => r.update({ id: 'a' }, f as Fence, { n: 1 })],
  ['upsert', (r, f) => r.upsert({ id: 'a', n: 1 }, f as Fence)],
  ['delete', (r, f) => r.delete({ id: 'a' }, f as Fence)],
  ['modify', (r, f) => r.modify({ id: 'a' }, f as Fence, (row) => ({ n: row.n + 1 }))],
  ['updateWhere', (r, f) => r.updateWhere(sql`true`, f as Fence, { n: 1 })],
  [
    'with(lease).update',
    (r, f) => r.with({ fence: f as Fence, signal: new AbortController().signal }).update({ id: 'a' }, { n: 1 }),
  ],
];

const BAD_WRITE_FENCES: [string, unknown][] = [
  ...BAD_FENCES,
  ...CONVERTIBLE.map(([label, value]): [string, unknown] => [`${label}, not a bigint`, value]),
];

type Patch = Parameters<FencedRepository<typeof items>['update']>[2];
const BAD_PATCHES: [string, unknown][] = [
  ['last_fence', { last_fence: 99n }],
  ['lastFence', { lastFence: 99n }],
  ['deleted_at', { deleted_at: null }],
  ['deletedAt', { deletedAt: new Date() }],
  ['the key column', { id: 'b' }],
  ['the key column with another', { id: 'a', n: 2 }],
  ['an unknown column', { nope: 1 }],
  ['a database column name instead of the property', { n: 1, last_fence: 1 }],
  ['null', null],
  ['an array', [['n', 1]]],
  ['a Map (no own keys: read as an object it would only move the fence)', new Map([['n', 1]])],
  ['a Set', new Set(['n'])],
  ['a string', 'n = 1'],
  ['an SQL fragment', sql`n = 1`],
];

/**
 * Patches that once slipped past the column check: an inherited member of
 * Object.prototype is no column, an own `__proto__` key (from JSON.parse) is
 * no column, and a null-prototype object is a plain patch (drizzle's `is()`
 * throws on it, so palisade must not ask it).
 */
const ODD_PATCHES: [string, unknown][] = [
  ["an inherited name ('toString')", { toString: 1 }],
  ["an own '__proto__' key (JSON.parse)", JSON.parse('{"__proto__": {"n": 9}}')],
  ['a null-prototype object', Object.assign(Object.create(null), { n: 5 })],
];

const BAD_KEYS: [string, unknown][] = [
  ['null', null],
  ['a string', 'a'],
  ['an array', ['a']],
  ['{}', {}],
  ['{ id: null }', { id: null }],
  ['{ id: undefined }', { id: undefined }],
  ['a non-key column only', { n: 1 }],
  ['the key plus a non-key column', { id: 'a', n: 1 }],
  ['an SQL expression as the key value', { id: sql`'a'` }],
];

const repositoryDrivers = drivers.map((d) => (d.name === 'pglite' ? { ...d, open: filePgliteDatabase } : d));

describe.each(repositoryDrivers)('repository bad input on $name', ({ open }) => {
  let test: TestDatabase;
  let logged: { db: Database; queries: string[] };
  let repo: FencedRepository<typeof items>;
  const stored = async () => (await test.db.select().from(items)).sort((a, b) => (a.id < b.id ? -1 : 1));

  beforeAll(async () => {
    test = await open();
    // Upserts read palisade's tombstone floor.
    await migrate(test.db);
    await test.db.execute(sql`create table bad_input_items (
      id text primary key, n integer not null default 0, last_fence bigint not null default 0, deleted_at timestamptz)`);
    await test.db.execute(sql`create table "we""ird" (
      "i""d" text primary key, "va""l; drop table x" text, last_fence bigint not null default 0, deleted_at timestamptz)`);
    logged = withQueryLog(test);
    repo = fencedRepository(logged.db, items);
  });
  afterAll(async () => {
    await test?.close();
  });
  beforeEach(async () => {
    await test.db.execute(sql`delete from bad_input_items`);
    await test.db.execute(sql`insert into bad_input_items (id, n, last_fence) values ('a', 7, 5)`);
    logged.queries.length = 0;
  });

  /** Bad input: refused with invalid_argument, no statement sent, the table as it was. */
  async function expectRefusedBeforeAnyQuery(call: () => unknown): Promise<void> {
    const before = await stored();
    logged.queries.length = 0;
    expectInvalid(await thrown(call));
    expect(logged.queries).toEqual([]);
    expect(await stored()).toEqual(before);
  }

  describe.each(WRITES)('%s', (_method, write) => {
    it.each(BAD_WRITE_FENCES)('refuses the fence %s', async (_label, fence) => {
      await expectRefusedBeforeAnyQuery(() => write(repo, fence));
    });
  });

  it('a valid fence goes through (the tables above can fail)', async () => {
    expect((await repo.update({ id: 'a' }, F(6n), { n: 8 })).status).toBe('applied');
    expect(logged.queries.length).toBeGreaterThan(0);
    expect((await stored())[0]).toMatchObject({ n: 8, lastFence: 6n });
  });

  describe.each([
    ['update', (patch: unknown) => repo.update({ id: 'a' }, F(9n), patch as Patch)],
    ['updateWhere', (patch: unknown) => repo.updateWhere(sql`true`, F(9n), patch as Patch)],
    ['modify', (patch: unknown) => repo.modify({ id: 'a' }, F(9n), () => patch as Patch)],
  ])('%s', (method, write) => {
    it.each(BAD_PATCHES)('refuses a patch with %s', async (_label, patch) => {
      if (method === 'modify') {
        // modify reads (and locks) the row before its function returns the patch: a query is sent, nothing is written.
        const before = await stored();
        expectInvalid(await thrown(() => write(patch)));
        expect(await stored()).toEqual(before);
      } else {
        await expectRefusedBeforeAnyQuery(() => write(patch));
      }
    });
  });

  it.each(ODD_PATCHES)('update: a patch with %s gets a typed answer', async (_l, patch) => {
    const err = await thrown(() => repo.update({ id: 'a' }, F(9n), patch as Patch));
    if (err !== undefined) expectInvalid(err);
  });

  it.each([
    ['last_fence', { id: 'a', n: 1, last_fence: 1n }],
    ['lastFence', { id: 'a', n: 1, lastFence: 1n }],
    ['deletedAt', { id: 'a', n: 1, deletedAt: null }],
    ['no key', { n: 1 }],
    ['a null key', { id: null, n: 1 }],
    ['an unknown column', { id: 'a', n: 1, nope: 2 }],
  ])('upsert refuses values with %s', async (_label, values) => {
    await expectRefusedBeforeAnyQuery(() => repo.upsert(values as never, F(9n)));
  });

  describe.each([
    ['get', (key: unknown) => repo.get(key as never)],
    ['update', (key: unknown) => repo.update(key as never, F(9n), { n: 1 })],
    ['delete', (key: unknown) => repo.delete(key as never, F(9n))],
    ['modify', (key: unknown) => repo.modify(key as never, F(9n), () => ({ n: 1 }))],
  ])('%s', (_method, call) => {
    it.each(BAD_KEYS)('refuses the key %s', async (_label, key) => {
      await expectRefusedBeforeAnyQuery(() => call(key));
    });
  });

  /**
   * A `where` must be drizzle SQL (`sql\`…\``, `eq(…)`, `and(…)`). A string
   * once went through as a *parameter*: `updateWhere('true', …)` sent
   * `where $1 and …` with `$1 = 'true'`, which Postgres cast to boolean — it
   * updated every row; `find('id = 1')` reached the server.
   */
  const BAD_WHERES: [string, unknown][] = [
    ["the string 'true'", 'true'],
    ["the string 'id = 1'", 'id = 1'],
    ['a boolean', true],
    ['a number', 1],
    ['a plain object', {}],
    ['an array', [sql`true`]],
    ['a column (not a condition)', items.id],
    ['null', null],
  ];

  it.each(BAD_WHERES)('updateWhere refuses %s as the condition', async (_label, where) => {
    await expectRefusedBeforeAnyQuery(() => repo.updateWhere(where as never, F(9n), { n: 1 }));
  });

  it.each(BAD_WHERES)('find refuses %s as the condition', async (_label, where) => {
    await expectRefusedBeforeAnyQuery(() => repo.find(where as never));
  });

  it.each(BAD_WHERES)('with(lease).updateWhere refuses %s as the condition', async (_label, where) => {
    const leased = repo.with({ fence: F(9n), signal: new AbortController().signal });
    await expectRefusedBeforeAnyQuery(() => leased.updateWhere(where as never, { n: 1 }));
  });

  it.each([
    ['null', null],
    ['undefined', undefined],
    ['an empty object', {}],
    ['a string', 'postgres://localhost/db'],
    ['a postgres.js-like function', () => undefined],
    ['an object with only execute', { execute: async () => [] }],
  ])('fencedRepository refuses %s as the database, at once', async (_label, db) => {
    await expectRefusedBeforeAnyQuery(() => fencedRepository(db as never, items));
  });

  it('refuses a missing modify function and a missing updateWhere condition', async () => {
    await expectRefusedBeforeAnyQuery(() => repo.modify({ id: 'a' }, F(9n), undefined as never));
    await expectRefusedBeforeAnyQuery(() => repo.updateWhere(undefined as never, F(9n), { n: 1 }));
  });

  it.each([
    ['an invalid Date', new Date(Number.NaN), undefined],
    ['a string date', '2020-01-01', undefined],
    ['batchSize 0', new Date(), 0],
    ['batchSize 1.5', new Date(), 1.5],
    ['batchSize -1', new Date(), -1],
  ])('purgeTombstones refuses %s', async (_label, olderThan, batchSize) => {
    await expectRefusedBeforeAnyQuery(() =>
      repo.purgeTombstones(olderThan as Date, batchSize === undefined ? {} : { batchSize }),
    );
  });

  it('a table and columns named with double quotes (and a semicolon) work: identifiers are quoted', async () => {
    const w = fencedRepository(test.db, weird);
    expect(await w.upsert({ id: 'k"1', val: 'x"y' }, F(1n))).toMatchObject({ status: 'applied' });
    expect(await w.update({ id: 'k"1' }, F(2n), { val: 'z' })).toMatchObject({ status: 'applied' });
    expect(await w.update({ id: 'k"1' }, F(1n), { val: 'stale' })).toEqual({ status: 'stale', currentFence: 2n });
    expect(await w.modify({ id: 'k"1' }, F(3n), (row) => ({ val: `${row.val}!` }))).toMatchObject({
      status: 'applied',
    });
    expect(await w.get({ id: 'k"1' })).toMatchObject({ id: 'k"1', val: 'z!', lastFence: 3n });
    expect(await w.updateWhere(sql`true`, F(4n), { val: 'all' })).toEqual({ applied: 1, stale: 0 });
    expect(await w.find()).toHaveLength(1);
    expect(await w.delete({ id: 'k"1' }, F(5n))).toMatchObject({ status: 'applied' });
    expect(await w.upsert({ id: 'k"1', val: 'back' }, F(4n))).toEqual({ status: 'stale', currentFence: 5n });
    expect(await w.purgeTombstones(new Date(Date.now() + 60_000))).toBe(1);
    // The names really are the quoted ones, and no other table appeared.
    const tables = await execute(test.db, sql`select relname from pg_class where relname like 'we%' and relkind = 'r'`);
    expect(tables.map((t) => t.relname)).toEqual(['we"ird']);
    const columns = await execute(
      test.db,
      sql`select attname from pg_attribute where attrelid = '"we""ird"'::regclass and attnum > 0 order by attnum`,
    );
    expect(columns.map((c) => c.attname)).toEqual(['i"d', 'va"l; drop table x', 'last_fence', 'deleted_at']);
  });
});

// ─── lock managers ─────────────────────────────────────────────────────────

interface Backend {
  readonly manager: LockManager;
  /** Everything this namespace has written to its backend, for before/after comparison. */
  state(): Promise<unknown>;
  /** Redis: keys of this namespace without an expiry (the fence counter excepted). Others: held leases without one. */
  locksWithoutExpiry(): Promise<string[]>;
  close(): Promise<void>;
}

const FENCE_SEQ = sql`select last_value::text as v, is_called from palisade.fence_seq`;

async function pgliteLeaseBackend(): Promise<Backend> {
  const db = drizzlePglite(filePglite()) as unknown as Database;
  await migrate(db);
  const namespace = `bad-${randomBytes(4).toString('hex')}`;
  const manager = postgresLockManager({ client: db, namespace });
  return {
    manager,
    state: async () => ({
      leases: await execute(db, sql`select * from palisade.leases where namespace = ${namespace} order by name`),
      fenceSeq: await execute(db, FENCE_SEQ),
    }),
    locksWithoutExpiry: async () =>
      (
        await execute(
          db,
          sql`select name from palisade.leases where namespace = ${namespace} and expires_at = 'infinity'`,
        )
      ).map((r) => String(r.name)),
    async close() {
      await manager.close();
    },
  };
}

async function serverBackend(kind: BackendKind): Promise<Backend> {
  const database = await postgresDatabase();
  await migrate(database.db);
  const namespace = `bad-${randomBytes(4).toString('hex')}`;
  const redisUrl = process.env.REDIS_URL;
  const cluster: EtcdCluster | undefined = kind === 'etcd' ? await startEtcdCluster(1) : undefined;
  const opened = await openManager({
    kind,
    namespace,
    databaseUrl: database.url as string,
    ...(redisUrl ? { redisUrl } : {}),
    ...(cluster ? { etcdEndpoints: cluster.endpoints } : {}),
  });
  const redis = kind === 'redis' ? new Redis(redisUrl as string) : undefined;
  const etcd = cluster ? new Etcd3({ hosts: cluster.endpoints }) : undefined;
  /** Every key of the namespace with whether it has a lease, and the cluster's revision (any write raises it). */
  const etcdState = async () => {
    const res = await (etcd as Etcd3).getAll().prefix(`palisade/${namespace}/`).exec();
    return {
      revision: res.header.revision,
      keys: res.kvs.map((kv) => [kv.key.toString(), kv.lease !== '0'] as const),
    };
  };
  const redisKeys = async () => {
    const keys: string[] = [];
    let cursor = '0';
    for (let i = 0; i < 10_000; i++) {
      const [next, batch] = await (redis as Redis).scan(cursor, 'MATCH', `{palisade:${namespace}}*`, 'COUNT', 1000);
      keys.push(...batch);
      cursor = next;
      if (cursor === '0') break;
    }
    return keys.sort();
  };
  return {
    manager: opened.manager,
    async state() {
      const db = database.db;
      const pg = {
        leases: await execute(db, sql`select * from palisade.leases where namespace = ${namespace} order by name`),
        fenceSeq: await execute(db, FENCE_SEQ),
        epochSeq: await execute(db, sql`select last_value::text as v, is_called from palisade.epoch_seq`),
        advisory: await execute(
          db,
          sql`select classid::text, objid::text from pg_locks where locktype = 'advisory' and granted
              and database = (select oid from pg_database where datname = current_database()) order by 1, 2`,
        ),
      };
      if (etcd) return { ...pg, etcd: await etcdState() };
      if (!redis) return pg;
      const keys = await redisKeys();
      const values = await Promise.all(keys.map(async (k) => [k, await redis.type(k), (await redis.pttl(k)) > 0]));
      return { ...pg, redis: values };
    },
    async locksWithoutExpiry() {
      // The namespace's source key has no lease by design (it names the fence source): lock and label keys do.
      if (etcd) {
        const { keys } = await etcdState();
        return keys.filter(([key, leased]) => !leased && !key.endsWith('/source')).map(([key]) => key);
      }
      if (redis) {
        const keys = (await redisKeys()).filter((k) => k.includes('}:lock:'));
        const ttls = await Promise.all(keys.map(async (k) => [k, await redis.pttl(k)] as const));
        return ttls.filter(([, ttl]) => ttl <= 0).map(([k]) => k);
      }
      const rows = await execute(
        database.db,
        sql`select name from palisade.leases where namespace = ${namespace} and expires_at = 'infinity'`,
      );
      return rows.map((r) => String(r.name));
    },
    async close() {
      await opened.close();
      redis?.disconnect();
      etcd?.close();
      await cluster?.stop();
      await database.close();
    },
  };
}

const backends: { name: string; open: () => Promise<Backend> }[] = [
  { name: 'postgres leases on PGlite', open: pgliteLeaseBackend },
  ...(needs('DATABASE_URL')
    ? [
        { name: 'postgres leases', open: () => serverBackend('postgres') },
        { name: 'postgres advisory', open: () => serverBackend('advisory') },
      ]
    : []),
  ...(needs('DATABASE_URL') && needs('REDIS_URL') ? [{ name: 'redis', open: () => serverBackend('redis') }] : []),
  ...(needs('DATABASE_URL') && needs('ETCD')
    ? [{ name: 'etcd (a one-member cluster of its own)', open: () => serverBackend('etcd') }]
    : []),
];

const BAD_TTLS: [string, unknown][] = [
  ['0', 0],
  ['-1', -1],
  ['NaN', Number.NaN],
  ['1.5', 1.5],
  ['Infinity', Number.POSITIVE_INFINITY],
  ['-Infinity', Number.NEGATIVE_INFINITY],
  ['1e17 (PX would accept it: a lock that never expires)', 1e17],
  ['one day + 1 ms', MAX_TTL_MS + 1],
  ['2^31', 2 ** 31],
  ["'1000' (a string)", '1000'],
  ['1000n (a bigint)', 1000n],
  ['null', null],
  ['undefined (no TTL)', undefined],
  ['{}', {}],
];

const BAD_NAMES: [string, unknown][] = [
  ['empty', ''],
  ['NUL', 'a\u0000b'],
  ['a lone high surrogate', '\uD800'],
  ['a lone low surrogate', 'a\uDC00b'],
  ['1,025 ASCII bytes', 'x'.repeat(1025)],
  ['1,026 bytes of €', '€'.repeat(342)],
  ['a number', 5],
  ['null', null],
  ['an object', { name: 'x' }],
];

const BAD_OPTIONS: [string, unknown][] = [
  ['no options', undefined],
  ['null options', null],
  ['waitMs -1', { ttlMs: 1000, waitMs: -1 }],
  ['waitMs NaN', { ttlMs: 1000, waitMs: Number.NaN }],
  ['waitMs Infinity', { ttlMs: 1000, waitMs: Number.POSITIVE_INFINITY }],
  ['a holder of 257 characters', { ttlMs: 1000, holder: 'h'.repeat(257) }],
  ['a holder with a lone surrogate', { ttlMs: 1000, holder: '\uDC00' }],
  ['a signal that is not an AbortSignal', { ttlMs: 1000, signal: {} }],
  ['maxHoldMs 0', { ttlMs: 1000, autoExtend: true, maxHoldMs: 0 }],
  ['a holder with NUL (Postgres refuses it with 22021)', { ttlMs: 1000, holder: 'worker\u00003' }],
  ['a holder that is not a string', { ttlMs: 1000, holder: 42 }],
  ["autoExtend 'yes' (a string, not true)", { ttlMs: 1000, autoExtend: 'yes' }],
  ["autoExtend 'false' (a truthy string)", { ttlMs: 1000, autoExtend: 'false' }],
  ['autoExtend 1', { ttlMs: 1000, autoExtend: 1 }],
  ['maxHoldMs without autoExtend (it would do nothing)', { ttlMs: 1000, maxHoldMs: 5000 }],
  ['maxHoldMs with autoExtend false', { ttlMs: 1000, autoExtend: false, maxHoldMs: 5000 }],
];

describe.each(backends)('lock manager bad input on $name', ({ open }) => {
  let b: Backend;
  beforeAll(async () => {
    b = await open();
  });
  afterAll(async () => {
    expect(await b?.locksWithoutExpiry()).toEqual([]);
    await b?.close();
  });

  /** Refused with invalid_argument, the backend exactly as before: nothing granted, no fence drawn, no key. */
  async function expectNothingWritten(call: () => unknown): Promise<void> {
    const before = await b.state();
    expectInvalid(await thrown(call));
    expect(await b.state()).toEqual(before);
  }

  const calls: [string, (name: unknown, options: unknown) => unknown][] = [
    ['acquire', (n, o) => b.manager.acquire(n as string, o as never)],
    ['tryAcquire', (n, o) => b.manager.tryAcquire(n as string, o as never)],
    ['using', (n, o) => b.manager.using(n as string, o as never, () => 'ran')],
    ['acquireAll', (n, o) => b.manager.acquireAll(['ok-name', n as string], o as never)],
  ];

  describe.each(calls)('%s', (_method, call) => {
    it.each(BAD_TTLS)('refuses ttlMs %s', async (_label, ttlMs) => {
      await expectNothingWritten(() => call('ttl-lock', { ttlMs, waitMs: 0 }));
    });
    it.each(BAD_NAMES)('refuses the name: %s', async (_label, name) => {
      await expectNothingWritten(() => call(name, { ttlMs: 1000, waitMs: 0 }));
    });
    it.each(BAD_OPTIONS)('refuses %s', async (_label, options) => {
      await expectNothingWritten(() => call('options-lock', options));
    });
  });

  it.each(BAD_NAMES)('inspect refuses the name: %s', async (_label, name) => {
    await expectNothingWritten(() => b.manager.inspect(name as string));
  });

  it('acquireAll refuses a non-array and an empty array', async () => {
    await expectNothingWritten(() => b.manager.acquireAll('x' as never, { ttlMs: 1000 }));
    await expectNothingWritten(() => b.manager.acquireAll([], { ttlMs: 1000 }));
  });

  it('extend refuses a bad TTL and leaves the lease as it was', async () => {
    const lease = await b.manager.acquire('extend-lock', { ttlMs: 10_000 });
    try {
      for (const [, ttl] of BAD_TTLS.filter(([, v]) => v !== undefined)) {
        expectInvalid(await thrown(() => lease.extend(ttl as number)));
      }
      expect(lease.signal.aborted).toBe(false);
      expect((await b.manager.inspect('extend-lock'))?.fence).toBe(lease.fence);
    } finally {
      expect(await lease.release()).toBe('released');
    }
  });

  it('accepts the edges: TTL 1 ms and one day, names of exactly 1,024 bytes', async () => {
    const short = await b.manager.acquire('edge-ttl-1', { ttlMs: 1 });
    await short.release(); // 'released' or 'lost' (it may have expired already): either way nothing stays
    const day = await b.manager.acquire('edge-ttl-day', { ttlMs: MAX_TTL_MS });
    expect(await day.release()).toBe('released');
    for (const name of ['x'.repeat(1024), `${'€'.repeat(341)}x`]) {
      const lease = await b.manager.acquire(name, { ttlMs: 10_000 });
      expect((await b.manager.inspect(name))?.fence).toBe(lease.fence);
      expect(await lease.release()).toBe('released');
    }
  });

  it('NFC and NFD spellings of one name are ONE lock (names are normalised to NFC)', async () => {
    const composed = 'caf\u00e9';
    const decomposed = 'cafe\u0301';
    expect(composed).not.toBe(decomposed);
    const first = await b.manager.acquire(composed, { ttlMs: 10_000 });
    try {
      expect(await b.manager.tryAcquire(decomposed, { ttlMs: 10_000 })).toBeNull();
      expect((await b.manager.inspect(decomposed))?.fence).toBe(first.fence);
    } finally {
      expect(await first.release()).toBe('released');
    }
    const second = await b.manager.acquire(decomposed, { ttlMs: 10_000 });
    expect(second.name).toBe(composed);
    expect(second.fence).toBeGreaterThan(first.fence);
    expect((await b.manager.inspect(composed))?.fence).toBe(second.fence);
    expect(await second.release()).toBe('released');
  });

  it('braces and colons are valid name characters; such locks collide with nothing', async () => {
    const names = ['{x}', 'x', '{x', 'x}', '}{', 'a:b', 'a', 'b', ':', '::', 'lock:x', 'grant:x', 'fence', 'released'];
    names.push(`{palisade:${'ns'}}:fence`, '}:lock:x', '{palisade:x}:lock:x');
    const leases = [];
    try {
      for (const name of names) leases.push(await b.manager.acquire(name, { ttlMs: 10_000, waitMs: 0 }));
      // All held at once: no name took another's lock, every fence is new and increasing.
      for (let i = 1; i < leases.length; i++) expect(leases[i]?.fence).toBeGreaterThan(leases[i - 1]?.fence as bigint);
      for (const [i, name] of names.entries()) expect((await b.manager.inspect(name))?.fence).toBe(leases[i]?.fence);
      // The backend's own keys (the Redis fence counter) were not touched: the next fence is higher still.
      const next = await b.manager.acquire('after', { ttlMs: 10_000 });
      expect(next.fence).toBeGreaterThan(leases.at(-1)?.fence as bigint);
      expect(await next.release()).toBe('released');
    } finally {
      for (const lease of leases) expect(await lease.release()).toBe('released');
    }
    for (const name of names) expect(await b.manager.inspect(name)).toBeNull();
  });
});

describe('lock manager constructors refuse what is not a client, at once', () => {
  it.each([
    ['an empty object as db', { db: {}, namespace: 'ns' }],
    ['a string as db', { db: 'postgres://localhost/db', namespace: 'ns' }],
    ['null as db', { db: null, namespace: 'ns' }],
    ['an object with only execute as db', { db: { execute: async () => [] }, namespace: 'ns' }],
    ['no options', undefined],
  ])('postgresLockManager refuses %s', (_label, options) => {
    expectInvalid(thrownAtOnce(() => postgresLockManager(options as never)));
  });

  it('postgresLockManager refuses a listen client that cannot LISTEN (it would silently poll), a bad lockTimeoutMs or commandTimeoutMs', async () => {
    const db = drizzlePglite(filePglite()) as unknown as Database;
    for (const lockTimeoutMs of [0, -1, 1.5, Number.NaN, '5000', MAX_TTL_MS + 1]) {
      expectInvalid(
        thrownAtOnce(() => postgresLockManager({ client: db, namespace: 'ns', lockTimeoutMs: lockTimeoutMs as never })),
      );
    }
    for (const commandTimeoutMs of [0, -1, 1.5, Number.NaN, '5000', 600_001]) {
      expectInvalid(
        thrownAtOnce(() =>
          postgresLockManager({ client: db, namespace: 'ns', commandTimeoutMs: commandTimeoutMs as never }),
        ),
      );
    }
    for (const listen of [{}, 'yes', true, 1]) {
      expectInvalid(thrownAtOnce(() => postgresLockManager({ client: db, namespace: 'ns', listen: listen as never })));
    }
  });

  it('a transaction is refused as the lease client, the Redis epochs database and claimRegisters.db: what it records would be seen by no other process', async () => {
    // Never connects: the options are refused before anything is sent.
    const redis = new Redis({ lazyConnect: true, host: '127.0.0.1', port: 1 });
    try {
      const db = drizzlePglite(filePglite()) as unknown as Database;
      await migrate(db);
      const errors = await db.transaction(async (tx) => {
        const caught: unknown[] = [];
        for (const make of [
          () => postgresLockManager({ client: tx as unknown as Database, namespace: 'ns' }),
          () => redisLockManager({ client: redis, namespace: 'ns', epochs: tx as unknown as Database }),
          () => postgresLockManager({ client: db, namespace: 'ns', claimRegisters: { db: tx as unknown as Database } }),
        ]) {
          try {
            make();
            caught.push(undefined);
          } catch (e) {
            caught.push(e);
          }
        }
        return caught;
      });
      for (const err of errors) {
        expectInvalid(err);
        expect((err as Error).message).toMatch(/not a transaction/);
      }
      // The database itself is accepted by both.
      postgresLockManager({ client: db, namespace: 'ns', listen: false });
      await redisLockManager({ client: redis, namespace: 'ns', epochs: db }).close();
    } finally {
      redis.disconnect();
    }
  });
});

// The lease backend on PGlite runs always; the server backends mark themselves here for global-setup.
void needs('DATABASE_URL');
void needs('REDIS_URL');
void needs('ETCD');
