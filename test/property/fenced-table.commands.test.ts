/**
 * Model-based test of one fenced table: random sequences of fenced writes
 * (update, SQL-expression update, upsert, delete, modify, updateWhere, purge)
 * and reads, by holders with old, equal and new fences, run against the real
 * repository and against an in-memory model of what palisade promises. After
 * every command the result (status, row, current fence, whether `modify`
 * called its function) must match the model; after every run the stored
 * table, tombstones included, must too. Shrinking is on: a failure prints the
 * shortest command list found, with its seed, path and replayPath (see
 * ./support.ts to replay).
 *
 * Runs on PGlite always and on the real Postgres when DATABASE_URL is set.
 * One database per driver for the whole file; the table is emptied between
 * runs.
 */
import { fc, test } from '@fast-check/vitest';
import { asc, gte, sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import type { Database } from '../../src/driver.js';
import { type Fence, MAX_FENCE, toFence } from '../../src/fencing/fence.js';
import { type FencedRepository, fencedRepository, type SameFence, type WriteResult } from '../../src/repo/index.js';
import { fenceColumns } from '../../src/schema/index.js';
import { drivers, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { commandsReplayPath, propertyParams, propertyTimeout } from './support.js';

// Marks the real-Postgres half for test/support/global-setup.ts.
void needs('DATABASE_URL');

const items = pgTable('palisade_prop_items', {
  id: text('id').primaryKey(),
  n: integer('n').notNull().default(0),
  label: text('label'),
  ...fenceColumns(),
});
type Items = typeof items;
type ItemRow = Items['$inferSelect'];

const KEYS = ['a', 'b', 'c'] as const;
type Key = (typeof KEYS)[number];

/** Few distinct fences, so holders collide: equal (duplicate), lower (stale) and higher. Spans int8, not just 2^53. */
const FENCES: readonly Fence[] = [1n, 2n, 3n, 4n, 2n ** 53n + 1n, 2n ** 62n, MAX_FENCE].map((f) => toFence(f));

interface ModelRow {
  n: number;
  label: string | null;
  fence: bigint;
  deleted: boolean;
}

interface Model {
  readonly mode: SameFence;
  readonly rows: Map<Key, ModelRow>;
}

interface Real {
  readonly db: Database;
  readonly repo: FencedRepository<Items>;
}

type Expected =
  | { status: 'applied'; row: ModelRow }
  | { status: 'stale'; current: bigint }
  | { status: 'duplicate' | 'missing' };

/** The fence comparison the repository was configured with. */
const allowed = (m: Model, rowFence: bigint, fence: bigint) =>
  m.mode === 'allow' ? rowFence <= fence : rowFence < fence;

/** Outcome of a fenced write on a live row that the comparison refused. */
const refused = (rowFence: bigint): Expected => ({ status: 'stale', current: rowFence });

function refusal(m: Model, row: ModelRow, fence: bigint): Expected {
  if (row.fence > fence) return refused(row.fence);
  if (m.mode === 'reject' && row.fence === fence) return { status: 'duplicate' };
  throw new Error('model: a write the comparison allows is not a refusal');
}

function checkResult(key: Key, got: WriteResult<ItemRow>, want: Expected): void {
  if (want.status === 'applied') {
    expect(got.status).toBe('applied');
    if (got.status !== 'applied') return;
    expect({
      id: got.row.id,
      n: got.row.n,
      label: got.row.label,
      fence: got.row.lastFence,
      deleted: got.row.deletedAt !== null,
    }).toEqual({ id: key, n: want.row.n, label: want.row.label, fence: want.row.fence, deleted: want.row.deleted });
    if (want.row.deleted) expect(got.row.deletedAt).toBeInstanceOf(Date);
    return;
  }
  if (want.status === 'stale') {
    expect(got).toEqual({ status: 'stale', currentFence: want.current });
    return;
  }
  expect(got).toEqual({ status: want.status });
}

/** The model's view of a plain (non-upsert) fenced update; mutates the model when it applies. */
function modelUpdate(m: Model, key: Key, fence: bigint, patch: (row: ModelRow) => Partial<ModelRow>): Expected {
  const row = m.rows.get(key);
  if (!row) return { status: 'missing' };
  if (row.deleted) {
    // A tombstone takes the fence (strictly higher only), so a lower one cannot resurrect the row later.
    if (row.fence < fence) row.fence = fence;
    return { status: 'missing' };
  }
  if (!allowed(m, row.fence, fence)) return refusal(m, row, fence);
  Object.assign(row, patch(row), { fence });
  return { status: 'applied', row: { ...row } };
}

const fenceArb = fc.nat({ max: FENCES.length - 1 }).map((i) => FENCES[i] as Fence);
const keyArb = fc.constantFrom(...KEYS);
const labelArb = fc.option(fc.string({ maxLength: 6 }), { nil: null });
const nArb = fc.integer({ min: -1000, max: 1000 });

class Upsert implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    readonly fence: Fence,
    readonly n: number,
    readonly label: string | null | undefined,
  ) {}
  check = () => true;
  async run(m: Model, r: Real) {
    const values =
      this.label === undefined ? { id: this.key, n: this.n } : { id: this.key, n: this.n, label: this.label };
    const got = await r.repo.upsert(values, this.fence);
    const row = m.rows.get(this.key);
    let want: Expected;
    if (!row) {
      const fresh = { n: this.n, label: this.label ?? null, fence: this.fence, deleted: false };
      m.rows.set(this.key, fresh);
      want = { status: 'applied', row: { ...fresh } };
    } else if (allowed(m, row.fence, this.fence)) {
      // Columns not given keep their values — also when a tombstone is revived.
      Object.assign(
        row,
        { n: this.n, fence: this.fence, deleted: false },
        this.label === undefined ? {} : { label: this.label },
      );
      want = { status: 'applied', row: { ...row } };
    } else {
      want = refusal(m, row, this.fence);
    }
    checkResult(this.key, got, want);
  }
  toString = () => `upsert(${this.key}, f${this.fence}, n=${this.n}, label=${JSON.stringify(this.label)})`;
}

class Update implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    readonly fence: Fence,
    readonly patch: { n?: number; label?: string | null },
  ) {}
  check = () => true;
  async run(m: Model, r: Real) {
    const got = await r.repo.update({ id: this.key }, this.fence, this.patch);
    checkResult(
      this.key,
      got,
      modelUpdate(m, this.key, this.fence, () => ({ ...this.patch })),
    );
  }
  toString = () => `update(${this.key}, f${this.fence}, ${JSON.stringify(this.patch)})`;
}

/** `n = n + 1` as an SQL expression: the database computes it from the current row. */
class Increment implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    readonly fence: Fence,
  ) {}
  check = () => true;
  async run(m: Model, r: Real) {
    const got = await r.repo.update({ id: this.key }, this.fence, { n: sql`${items.n} + 1` });
    checkResult(
      this.key,
      got,
      modelUpdate(m, this.key, this.fence, (row) => ({ n: row.n + 1 })),
    );
  }
  toString = () => `increment(${this.key}, f${this.fence})`;
}

class Modify implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    readonly fence: Fence,
    readonly delta: number,
  ) {}
  check = () => true;
  async run(m: Model, r: Real) {
    const before = m.rows.get(this.key);
    const seen: ItemRow[] = [];
    const got = await r.repo.modify({ id: this.key }, this.fence, (row) => {
      seen.push(row);
      return { n: row.n + this.delta };
    });
    const writable = before !== undefined && !before.deleted && allowed(m, before.fence, this.fence);
    // fn runs exactly when the write can apply, and sees the row as stored.
    expect(seen.length).toBe(writable ? 1 : 0);
    if (writable && before) {
      expect({ n: seen[0]?.n, label: seen[0]?.label, fence: seen[0]?.lastFence }).toEqual({
        n: before.n,
        label: before.label,
        fence: before.fence,
      });
    }
    checkResult(
      this.key,
      got,
      modelUpdate(m, this.key, this.fence, (row) => ({ n: row.n + this.delta })),
    );
  }
  toString = () => `modify(${this.key}, f${this.fence}, n += ${this.delta})`;
}

class Delete implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    readonly fence: Fence,
  ) {}
  check = () => true;
  async run(m: Model, r: Real) {
    const got = await r.repo.delete({ id: this.key }, this.fence);
    const row = m.rows.get(this.key);
    let want: Expected;
    if (!row) want = { status: 'missing' };
    else if (row.deleted) {
      if (allowed(m, row.fence, this.fence)) row.fence = this.fence;
      want = { status: 'missing' };
    } else if (allowed(m, row.fence, this.fence)) {
      Object.assign(row, { deleted: true, fence: this.fence });
      want = { status: 'applied', row: { ...row } };
    } else want = refusal(m, row, this.fence);
    checkResult(this.key, got, want);
  }
  toString = () => `delete(${this.key}, f${this.fence})`;
}

class UpdateWhere implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly fence: Fence,
    readonly minN: number,
    readonly label: string | null,
    readonly allOrNothing: boolean,
  ) {}
  check = () => true;
  async run(m: Model, r: Real) {
    const got = await r.repo.updateWhere(
      gte(items.n, this.minN),
      this.fence,
      { label: this.label },
      {
        allOrNothing: this.allOrNothing,
      },
    );
    const target = [...m.rows.values()].filter((row) => !row.deleted && row.n >= this.minN);
    const writable = target.filter((row) => allowed(m, row.fence, this.fence));
    // `stale` counts the rows at or above the fence; with allOrNothing one of them stops the whole batch.
    const stale = target.length - writable.length;
    const applied = this.allOrNothing && stale > 0 ? [] : writable;
    for (const row of applied) Object.assign(row, { label: this.label, fence: this.fence });
    expect(got).toEqual({ applied: applied.length, stale });
  }
  toString = () =>
    `updateWhere(n >= ${this.minN}, f${this.fence}, label=${JSON.stringify(this.label)}${this.allOrNothing ? ', allOrNothing' : ''})`;
}

/** Purging every tombstone: afterwards a lower fence may recreate the row (the documented trade-off). */
class Purge implements fc.AsyncCommand<Model, Real> {
  check = () => true;
  async run(m: Model, r: Real) {
    const got = await r.repo.purgeTombstones(new Date(Date.now() + 3_600_000));
    let removed = 0;
    for (const [key, row] of m.rows) {
      if (row.deleted) {
        m.rows.delete(key);
        removed++;
      }
    }
    expect(got).toBe(removed);
  }
  toString = () => 'purgeTombstones(all)';
}

class Get implements fc.AsyncCommand<Model, Real> {
  constructor(readonly key: Key) {}
  check = () => true;
  async run(m: Model, r: Real) {
    const got = await r.repo.get({ id: this.key });
    const row = m.rows.get(this.key);
    if (!row || row.deleted) expect(got).toBeUndefined();
    else
      expect(got && { n: got.n, label: got.label, fence: got.lastFence }).toEqual({
        n: row.n,
        label: row.label,
        fence: row.fence,
      });
  }
  toString = () => `get(${this.key})`;
}

const commandArbs = [
  fc
    .tuple(keyArb, fenceArb, nArb, fc.option(labelArb, { nil: undefined }))
    .map(([k, f, n, l]) => new Upsert(k, f, n, l)),
  fc
    .tuple(keyArb, fenceArb, fc.record({ n: nArb, label: labelArb }, { requiredKeys: [], noNullPrototype: true }))
    .map(([k, f, p]) => new Update(k, f, p)),
  fc.tuple(keyArb, fenceArb).map(([k, f]) => new Increment(k, f)),
  fc.tuple(keyArb, fenceArb, fc.integer({ min: -5, max: 5 })).map(([k, f, d]) => new Modify(k, f, d)),
  fc.tuple(keyArb, fenceArb).map(([k, f]) => new Delete(k, f)),
  fc
    .tuple(fenceArb, fc.integer({ min: -1000, max: 1000 }), labelArb, fc.boolean())
    .map(([f, min, l, all]) => new UpdateWhere(f, min, l, all)),
  fc.constant(null).map(() => new Purge()),
  keyArb.map((k) => new Get(k)),
];

/** The stored table, tombstones included, against the model. */
async function checkStored(db: Database, m: Model): Promise<void> {
  const stored = await db.select().from(items).orderBy(asc(items.id));
  const want = [...m.rows.entries()]
    .sort(([a], [b]) => (a < b ? -1 : 1))
    .map(([id, row]) => ({ id, n: row.n, label: row.label, fence: row.fence, deleted: row.deleted }));
  expect(
    stored.map((row) => ({
      id: row.id,
      n: row.n,
      label: row.label,
      fence: row.lastFence,
      deleted: row.deletedAt !== null,
    })),
  ).toEqual(want);
}

for (const driver of drivers) {
  describe(`fenced table model (${driver.name})`, () => {
    let test_: TestDatabase;
    beforeAll(async () => {
      test_ = await driver.open();
      await test_.db.execute(sql`create table palisade_prop_items (
        id text primary key,
        n integer not null default 0,
        label text,
        last_fence bigint not null default 0,
        deleted_at timestamptz
      )`);
    });
    afterAll(async () => {
      await test_?.close();
    });

    test.prop(
      [
        fc.constantFrom<SameFence>('reject', 'allow'),
        fc.commands(commandArbs, { maxCommands: 20, replayPath: commandsReplayPath() }),
      ],
      propertyParams(),
    )(
      'every write and read matches the model',
      async (mode, commands) => {
        await test_.db.execute(sql`delete from palisade_prop_items`);
        const model: Model = { mode, rows: new Map() };
        const real: Real = { db: test_.db, repo: fencedRepository(test_.db, items, { sameFence: mode }) };
        await fc.asyncModelRun(() => ({ model, real }), commands);
        await checkStored(test_.db, model);
      },
      propertyTimeout(120_000),
    );
  });
}
