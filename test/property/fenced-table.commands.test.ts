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
import { migrate } from '../../src/migrate.js';
import { type FencedRepository, fencedRepository } from '../../src/repo/repository.js';
import type { WriteResult } from '../../src/repo/result.js';
import type { SameFence } from '../../src/repo/statements.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
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

/**
 * Fences by index, increasing: small ones, then just above 2^53 (where a
 * `number` would have rounded), then the top of int8. Commands pick a fence
 * relative to the latest one issued (fresh, the same, an old one, a leap),
 * as holders of successive grants and stale holders would.
 */
const FENCE_COUNT = 30;
function fenceAt(i: number): Fence {
  const n = BigInt(i);
  if (i < 10) return toFence(n + 1n);
  if (i < 20) return toFence(2n ** 53n + n - 9n);
  return toFence(MAX_FENCE - BigInt(FENCE_COUNT - 1 - i));
}

type FenceChoice = { kind: 'fresh' } | { kind: 'same' } | { kind: 'leap' } | { kind: 'old'; back: number };

const fenceChoiceArb: fc.Arbitrary<FenceChoice> = fc.oneof(
  { weight: 3, arbitrary: fc.constant({ kind: 'fresh' } as const) },
  { weight: 3, arbitrary: fc.constant({ kind: 'same' } as const) },
  { weight: 2, arbitrary: fc.integer({ min: 1, max: 4 }).map((back) => ({ kind: 'old', back }) as const) },
  { weight: 1, arbitrary: fc.constant({ kind: 'leap' } as const) },
);

/** The fence a command uses, from the model's latest grant; a fresh one becomes the latest. */
function resolveFence(m: Model, choice: FenceChoice): Fence {
  const top = FENCE_COUNT - 1;
  let i: number;
  switch (choice.kind) {
    case 'fresh':
      i = Math.min(top, m.issued + 1);
      break;
    case 'leap':
      i = Math.min(top, m.issued + 10);
      break;
    case 'same':
      i = Math.max(0, m.issued);
      break;
    case 'old':
      i = Math.max(0, m.issued - choice.back);
      break;
  }
  m.issued = Math.max(m.issued, i);
  return fenceAt(i);
}

const show = (choice: FenceChoice, used: Fence | undefined) =>
  `${choice.kind}${choice.kind === 'old' ? `-${choice.back}` : ''}${used === undefined ? '' : `=f${used}`}`;

interface ModelRow {
  n: number;
  label: string | null;
  fence: bigint;
  deleted: boolean;
}

interface Model {
  readonly mode: SameFence;
  readonly rows: Map<Key, ModelRow>;
  /** Index of the latest fence granted (-1: none yet). */
  issued: number;
  /** The table's tombstone floor: the highest fence purged so far (0: none). */
  floor: bigint;
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
  // A tombstone is not live: the write finds no row and writes nothing, its fence included.
  if (row.deleted) return { status: 'missing' };
  if (!allowed(m, row.fence, fence)) return refusal(m, row, fence);
  Object.assign(row, patch(row), { fence });
  return { status: 'applied', row: { ...row } };
}

const keyArb = fc.constantFrom(...KEYS);
const labelArb = fc.option(fc.string({ maxLength: 6 }), { nil: null });
const nArb = fc.integer({ min: -1000, max: 1000 });

/** A command that writes with a fence chosen relative to the latest grant. */
abstract class Fenced {
  used: Fence | undefined;
  constructor(readonly choice: FenceChoice) {}
  protected use(m: Model): Fence {
    this.used = resolveFence(m, this.choice);
    return this.used;
  }
  protected get f(): string {
    return show(this.choice, this.used);
  }
}

class Upsert extends Fenced implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    choice: FenceChoice,
    readonly n: number,
    readonly label: string | null | undefined,
  ) {
    super(choice);
  }
  check = () => true;
  async run(m: Model, r: Real) {
    const fence = this.use(m);
    const values =
      this.label === undefined ? { id: this.key, n: this.n } : { id: this.key, n: this.n, label: this.label };
    const got = await r.repo.upsert(values, fence);
    const row = m.rows.get(this.key);
    let want: Expected;
    if (!row && !allowed(m, m.floor, fence)) {
      // A row that does not exist needs a fence above the tombstone floor that purges raised.
      want = refused(m.floor);
    } else if (!row) {
      const fresh = { n: this.n, label: this.label ?? null, fence: fence, deleted: false };
      m.rows.set(this.key, fresh);
      want = { status: 'applied', row: { ...fresh } };
    } else if (allowed(m, row.fence, fence)) {
      // Columns not given keep their values on a live row; a revived tombstone is a new row and takes their defaults.
      const label = this.label !== undefined ? this.label : row.deleted ? null : row.label;
      Object.assign(row, { n: this.n, label, fence, deleted: false });
      want = { status: 'applied', row: { ...row } };
    } else {
      want = refusal(m, row, fence);
    }
    checkResult(this.key, got, want);
  }
  override toString = () => `upsert(${this.key}, ${this.f}, n=${this.n}, label=${JSON.stringify(this.label)})`;
}

class Update extends Fenced implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    choice: FenceChoice,
    readonly patch: { n?: number; label?: string | null },
  ) {
    super(choice);
  }
  check = () => true;
  async run(m: Model, r: Real) {
    const fence = this.use(m);
    const got = await r.repo.update({ id: this.key }, fence, this.patch);
    checkResult(
      this.key,
      got,
      modelUpdate(m, this.key, fence, () => ({ ...this.patch })),
    );
  }
  override toString = () => `update(${this.key}, ${this.f}, ${JSON.stringify(this.patch)})`;
}

/** `n = n + 1` as an SQL expression: the database computes it from the current row. */
class Increment extends Fenced implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    choice: FenceChoice,
  ) {
    super(choice);
  }
  check = () => true;
  async run(m: Model, r: Real) {
    const fence = this.use(m);
    const got = await r.repo.update({ id: this.key }, fence, { n: sql`${items.n} + 1` });
    checkResult(
      this.key,
      got,
      modelUpdate(m, this.key, fence, (row) => ({ n: row.n + 1 })),
    );
  }
  override toString = () => `increment(${this.key}, ${this.f})`;
}

class Modify extends Fenced implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    choice: FenceChoice,
    readonly delta: number,
  ) {
    super(choice);
  }
  check = () => true;
  async run(m: Model, r: Real) {
    const fence = this.use(m);
    const before = m.rows.get(this.key);
    const seen: ItemRow[] = [];
    const got = await r.repo.modify({ id: this.key }, fence, (row) => {
      seen.push(row);
      return { n: row.n + this.delta };
    });
    const writable = before !== undefined && !before.deleted && allowed(m, before.fence, fence);
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
      modelUpdate(m, this.key, fence, (row) => ({ n: row.n + this.delta })),
    );
  }
  override toString = () => `modify(${this.key}, ${this.f}, n += ${this.delta})`;
}

class Delete extends Fenced implements fc.AsyncCommand<Model, Real> {
  constructor(
    readonly key: Key,
    choice: FenceChoice,
  ) {
    super(choice);
  }
  check = () => true;
  async run(m: Model, r: Real) {
    const fence = this.use(m);
    const got = await r.repo.delete({ id: this.key }, fence);
    const row = m.rows.get(this.key);
    let want: Expected;
    if (!row) want = { status: 'missing' };
    else if (row.deleted) want = { status: 'missing' };
    else if (allowed(m, row.fence, fence)) {
      Object.assign(row, { deleted: true, fence: fence });
      want = { status: 'applied', row: { ...row } };
    } else want = refusal(m, row, fence);
    checkResult(this.key, got, want);
  }
  override toString = () => `delete(${this.key}, ${this.f})`;
}

class UpdateWhere extends Fenced implements fc.AsyncCommand<Model, Real> {
  constructor(
    choice: FenceChoice,
    readonly minN: number,
    readonly label: string | null,
    readonly allOrNothing: boolean,
  ) {
    super(choice);
  }
  check = () => true;
  async run(m: Model, r: Real) {
    const fence = this.use(m);
    const got = await r.repo.updateWhere(
      gte(items.n, this.minN),
      fence,
      { label: this.label },
      {
        allOrNothing: this.allOrNothing,
      },
    );
    const target = [...m.rows.values()].filter((row) => !row.deleted && row.n >= this.minN);
    const writable = target.filter((row) => allowed(m, row.fence, fence));
    // `stale` counts the rows at or above the fence; with allOrNothing one of them stops the whole batch.
    const stale = target.length - writable.length;
    const applied = this.allOrNothing && stale > 0 ? [] : writable;
    for (const row of applied) Object.assign(row, { label: this.label, fence: fence });
    expect(got).toEqual({ applied: applied.length, stale });
  }
  override toString = () =>
    `updateWhere(n >= ${this.minN}, ${this.f}, label=${JSON.stringify(this.label)}${this.allOrNothing ? ', allOrNothing' : ''})`;
}

/** Purging every tombstone raises the floor to the highest fence removed: no lower fence may recreate a row. */
class Purge implements fc.AsyncCommand<Model, Real> {
  check = () => true;
  async run(m: Model, r: Real) {
    const got = await r.repo.purgeTombstones(new Date(Date.now() + 3_600_000));
    let removed = 0;
    for (const [key, row] of m.rows) {
      if (row.deleted) {
        m.rows.delete(key);
        if (row.fence > m.floor) m.floor = row.fence;
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

const upsertArb = fc
  .tuple(keyArb, fenceChoiceArb, nArb, fc.option(labelArb, { nil: undefined }))
  .map(([k, f, n, l]) => new Upsert(k, f, n, l));
const updateArb = fc
  .tuple(keyArb, fenceChoiceArb, fc.record({ n: nArb, label: labelArb }, { requiredKeys: [], noNullPrototype: true }))
  .map(([k, f, p]) => new Update(k, f, p));
const deleteArb = fc.tuple(keyArb, fenceChoiceArb).map(([k, f]) => new Delete(k, f));

// fc.commands picks uniformly among these: the plain writes appear twice, so rows are created, changed and deleted often.
const commandArbs = [
  upsertArb,
  upsertArb,
  updateArb,
  deleteArb,
  deleteArb,
  fc.tuple(keyArb, fenceChoiceArb).map(([k, f]) => new Increment(k, f)),
  fc.tuple(keyArb, fenceChoiceArb, fc.integer({ min: -5, max: 5 })).map(([k, f, d]) => new Modify(k, f, d)),
  fc
    .tuple(fenceChoiceArb, fc.integer({ min: -1000, max: 1000 }), labelArb, fc.boolean())
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

// postgres.js and PGlite: the model checks the repository's SQL, which is the same on every driver;
// node-postgres runs the repository, migrate and lock suites, and a third 1,000-run model would cost
// `npm test` about a minute on the 2-core machine.
for (const driver of drivers.filter((d) => d.name !== 'node-postgres')) {
  describe(`fenced table model (${driver.name})`, () => {
    let test_: TestDatabase;
    beforeAll(async () => {
      test_ = await driver.open();
      await migrate(test_.db);
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
        fc.commands(commandArbs, { maxCommands: 20, size: 'max', replayPath: commandsReplayPath() }),
      ],
      propertyParams(),
    )(
      'every write and read matches the model',
      async (mode, commands) => {
        await test_.db.execute(sql`delete from palisade_prop_items`);
        await test_.db.execute(sql`delete from palisade.tombstone_floors`);
        const model: Model = { mode, rows: new Map(), issued: -1, floor: 0n };
        const real: Real = { db: test_.db, repo: fencedRepository(test_.db, items, { sameFence: mode }) };
        await fc.asyncModelRun(() => ({ model, real }), commands);
        await checkStored(test_.db, model);
      },
      propertyTimeout(120_000),
    );
  });
}
