/**
 * The fence trigger under the table's own triggers, searched: a table
 * (plain, range-partitioned, or partitioned with a partition made after the
 * install) gets the fence trigger and up to three `BEFORE UPDATE` row
 * triggers of the user's, with names on both sides of palisade's key guard
 * in byte order, each doing one thing to the row (change its key within its
 * partition or into another, keep or raise its fence, resurrect it, restore
 * the old row, write another row of the table, set a time zone) to every
 * row, to tombstones or to live rows. Then a random sequence of writes:
 * palisade's (`update`, `upsert`, `delete`, `purgeTombstones`) at fresh or
 * stale fences, and plain SQL from outside palisade through the table's name
 * or a partition's (an `UPDATE` that sets, raises or resurrects, one that
 * changes the key, every row at once, `MERGE`, `INSERT … ON CONFLICT DO
 * UPDATE` of a row that exists, a `DELETE` of a row or of every tombstone).
 *
 * The model: each key's claim, the highest fence that ever wrote it — a
 * palisade write that applied, a plain statement that succeeded on a row
 * that key held before it (the fence it set), or a fence seen on the key's
 * row after a statement. After every statement:
 * - a statement that failed changed nothing (rows and tombstone floors);
 * - a palisade write at a fence no higher than its key's claim did not apply;
 * - for every key ever claimed, an upsert at the claim (in a transaction
 *   rolled back) does not apply: the claim still stands in the row or in the
 *   table's tombstone floor, wherever the triggers moved the row;
 * - where the user's triggers only raise the fence or do nothing, no write
 *   that raises the fence of a row it may write is refused.
 *
 * Left out, as the README documents it: a trigger whose name sorts after
 * the key guard and that moves a tombstone to another partition (the floor
 * then rises only to the tombstone's fence before the update), and a plain
 * `INSERT` of a key that does not exist (the trigger does not guard
 * `INSERT`).
 */
import { fc } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { integer, pgTable } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute, int8 } from '../../src/driver.js';
import { DatabaseError } from '../../src/errors.js';
import { toFence } from '../../src/fencing/fence.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { WriteResult } from '../../src/repo/result.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { installFenceTrigger } from '../../src/schema/fence-trigger.js';
import { pgliteDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const COLUMNS =
  'id integer primary key, stock integer not null default 0, last_fence bigint not null default 0, deleted_at timestamptz';
const gadgets = (name: string) =>
  pgTable(name, { id: integer('id').primaryKey(), stock: integer('stock').notNull(), ...fenceColumns() });

/** The keys the writes aim at; the triggers move rows to others (+1 stays in the partition, +10 leaves it). */
const KEYS = [1, 2, 3, 4, 5, 6] as const;
const KEY_GUARD = '~palisade_fence_guard_key';

type Layout = 'plain' | 'range' | 'range-late';
type Action =
  | 'noop'
  | 'move-near'
  | 'move-far'
  | 'keep-fence'
  | 'bump-fence'
  | 'resurrect'
  | 'revert'
  | 'nested'
  | 'timezone';
type Rows = 'all' | 'tombstones' | 'live';
interface UserTrigger {
  readonly name: string;
  readonly on: 'root' | 'first-partition';
  readonly action: Action;
  readonly rows: Rows;
}

/** Names on both sides of the key guard: control characters, letters, digits, `_`, `~a`; `~z`, DEL, non-ASCII. */
const TRIGGER_NAMES = [
  '\u0001ctl',
  'a_audit',
  'Z_stamp',
  '0_first',
  '_hidden',
  'palisade_user',
  'zz_archive',
  '~a_tilde',
  '~palisade_fence_guard_kex',
  '~palisade_fence_guard_key_z',
  '~z_tilde',
  '~~last',
  '\u007fdel',
  'é_accent',
];
const after = (name: string) => Buffer.compare(Buffer.from(name), Buffer.from(KEY_GUARD)) > 0;
/** Actions that never make a fenced write fail: with only these, every write that raises the fence passes. */
const BENIGN: ReadonlySet<Action> = new Set(['noop', 'bump-fence', 'timezone']);

const fenceChoice = fc.oneof(fc.constant('fresh' as const), fc.constant('stale' as const));
const key = fc.constantFrom(...KEYS);
const via = fc.constantFrom('root' as const, 'partition' as const);
const op = fc.oneof(
  fc.record({ kind: fc.constantFrom('update', 'upsert', 'delete'), key, fence: fenceChoice }),
  fc.record({ kind: fc.constant('purge') }),
  fc.record({
    kind: fc.constantFrom('set', 'raise', 'resurrect', 'merge', 'conflict', 'rekey', 'erase'),
    key,
    fence: fenceChoice,
    via,
  }),
  fc.record({ kind: fc.constantFrom('raise-all', 'erase-tombstones'), via }),
);
type Op = typeof op extends fc.Arbitrary<infer T> ? T : never;

const userTrigger = fc
  .record({
    name: fc.constantFrom(...TRIGGER_NAMES),
    on: fc.constantFrom('root' as const, 'first-partition' as const),
    // A move twice as often as the rest: it is what takes a key's fence away.
    action: fc.oneof(
      { arbitrary: fc.constantFrom<Action>('move-near', 'move-far'), weight: 4 },
      {
        arbitrary: fc.constantFrom<Action>(
          'noop',
          'keep-fence',
          'bump-fence',
          'resurrect',
          'revert',
          'nested',
          'timezone',
        ),
        weight: 7,
      },
    ),
    rows: fc.constantFrom<Rows>('all', 'tombstones', 'live'),
  })
  // The documented limit: a trigger after the key guard that moves a tombstone out of its partition.
  .map((t): UserTrigger => (after(t.name) && t.action === 'move-far' ? { ...t, rows: 'live' } : t));

/**
 * The other documented limit: a trigger that puts the old fence back and one that raises it afterwards leave
 * the row above its old fence but below the statement's — taken as the row's fence. Such runs keep the first.
 */
function apart(triggers: UserTrigger[]): UserTrigger[] {
  const lowers = triggers.some((t) => t.action === 'keep-fence' || t.action === 'revert');
  return lowers ? triggers.map((t) => (t.action === 'bump-fence' ? { ...t, action: 'noop' } : t)) : triggers;
}

const scenario = fc.record({
  layout: fc.oneof(
    fc.constant<Layout>('plain'),
    fc.constantFrom<Layout>('range', 'range-late'),
    fc.constantFrom<Layout>('range', 'range-late'),
  ),
  triggers: fc.array(userTrigger, { minLength: 1, maxLength: 3 }).map(apart),
  tombstones: fc.subarray([...KEYS]),
  ops: fc.array(op, { minLength: 1, maxLength: 12 }),
});
type Scenario = typeof scenario extends fc.Arbitrary<infer T> ? T : never;

interface Row {
  readonly stock: number;
  readonly fence: bigint;
  readonly deleted: boolean;
}

const partitionOf = (id: number) => (id < 10 ? 0 : id < 20 ? 1 : 2);
const ACTION_SQL: Record<Action, (root: string) => string> = {
  noop: () => 'null;',
  'move-near': () => 'NEW.id := NEW.id + 1;',
  'move-far': () => 'NEW.id := NEW.id + 10;',
  'keep-fence': () => 'NEW.last_fence := OLD.last_fence;',
  'bump-fence': () => 'NEW.last_fence := NEW.last_fence + 1;',
  resurrect: () => 'NEW.deleted_at := null;',
  revert: () => 'NEW := OLD;',
  // Another row of the same table, written from inside the update (not again from that write's own triggers).
  nested: (root) =>
    `if pg_trigger_depth() < 2 then update ${root} set last_fence = last_fence + 1 where id = OLD.id % 6 + 1; end if;`,
  timezone: () => "set local timezone = 'Asia/Kathmandu';",
};
const ROWS_SQL: Record<Rows, string> = {
  all: 'true',
  tombstones: 'OLD.deleted_at is not null',
  live: 'OLD.deleted_at is null',
};

let runs = 0;

/** A table of the scenario's layout with the fence trigger, every key written through palisade, then the user's triggers. */
async function setUp(db: Database, s: Scenario) {
  const root = `keyed_${process.pid}_${++runs}`;
  const partitioned = s.layout !== 'plain';
  const partitions = partitioned ? [0, 1, 2].map((i) => `${root}_p${i}`) : [];
  const bounds = ['0) to (10', '10) to (20', '20) to (1000'];
  const run = (text: string) => execute(db, sql.raw(text));
  await run(`create table ${root} (${COLUMNS})${partitioned ? ' partition by range (id)' : ''}`);
  const makePartition = (i: number) =>
    run(`create table ${partitions[i]} partition of ${root} for values from (${bounds[i]})`);
  if (partitioned) {
    await makePartition(0);
    await makePartition(1);
    if (s.layout === 'range') await makePartition(2);
  }
  await installFenceTrigger(db, { name: root });
  // Made after the install: it has the row triggers Postgres copies from the root, no statement triggers.
  if (s.layout === 'range-late') await makePartition(2);
  const table = gadgets(root);
  const repo = fencedRepository(db, table);
  // Every key live, some deleted since — before the user's triggers can get in the way.
  let fence = 0;
  for (const id of KEYS) expect((await repo.upsert({ id, stock: 0 }, toFence(++fence))).status).toBe('applied');
  for (const id of s.tombstones) expect((await repo.delete({ id }, toFence(++fence))).status).toBe('applied');
  for (const [i, t] of s.triggers.entries()) {
    const fn = `${root}_u${i}`;
    await run(`create function ${fn}() returns trigger language plpgsql as $$ begin
      if ${ROWS_SQL[t.rows]} then ${ACTION_SQL[t.action](root)} end if;
      return NEW; end $$`);
    const target = t.on === 'first-partition' && partitioned ? partitions[0] : root;
    await run(`create trigger "${t.name}${i}" before update on ${target} for each row execute function ${fn}()`);
  }
  /** The name a statement `via` the root or a partition writes key `id` through. */
  const nameFor = (id: number, via: 'root' | 'partition') =>
    via === 'partition' && partitioned ? (partitions[partitionOf(id)] as string) : root;
  return { root, table, repo, run, nameFor };
}

/** Every row of the table, by key. */
async function rowsOf(db: Database, root: string): Promise<Map<number, Row>> {
  const found = await execute(
    db,
    sql.raw(`select id, stock, last_fence, deleted_at is not null as deleted from ${root} order by id`),
  );
  return new Map(
    found.map((r) => [
      Number(r.id),
      { stock: Number(r.stock), fence: int8(r.last_fence) ?? 0n, deleted: r.deleted === true },
    ]),
  );
}

/** The table's tombstone floor (0 while it has none). */
async function floorOf(db: Database, root: string): Promise<bigint> {
  const [r] = await execute(
    db,
    sql.raw(`select floor from palisade.tombstone_floors where fenced_table = '${root}'::regclass`),
  );
  return (r && int8(r.floor)) || 0n;
}

/** What one operation sends, and what the model takes from it if it succeeds. */
interface Planned {
  readonly write: () => Promise<unknown>;
  /** The fence of a palisade write, and its key. */
  readonly palisade?: { readonly key: number; readonly fence: bigint };
  /** Fences a plain statement sets, by the key whose row it found: claimed if it succeeds. */
  readonly sets: ReadonlyMap<number, bigint>;
  /** Whether a trigger that only raises the fence (or does nothing) may refuse it. */
  readonly refusable: boolean;
}

/** One run: the scenario's table, its writes and the checks after each; the table is dropped after it. */
async function play(db: Database, s: Scenario): Promise<void> {
  const made = await setUp(db, s);
  try {
    await exercise(db, s, made);
  } finally {
    await made.run(`drop table ${made.root} cascade`);
    for (const i of s.triggers.keys()) await made.run(`drop function ${made.root}_u${i}()`);
  }
}

async function exercise(db: Database, s: Scenario, made: Awaited<ReturnType<typeof setUp>>): Promise<void> {
  const { root, table, repo, run, nameFor } = made;
  const benign = s.triggers.every((t) => BENIGN.has(t.action));
  // Each key's claim: the highest fence that ever wrote it.
  const claims = new Map<number, bigint>();
  const claim = (id: number, fence: bigint) => {
    if (fence > (claims.get(id) ?? 0n)) claims.set(id, fence);
  };
  const observe = (rows: Map<number, Row>) => {
    for (const [id, r] of rows) claim(id, r.fence);
  };
  let issued = 0n;
  let stale = 0;
  // Fresh: above every claim. Stale: the key's claim or one below it, alternately.
  const fenceFor = (choice: 'fresh' | 'stale', id: number): bigint => {
    for (const c of claims.values()) if (c > issued) issued = c;
    if (choice === 'fresh') return ++issued;
    const c = (claims.get(id) ?? 1n) - BigInt(stale++ % 2);
    return c > 0n ? c : 1n;
  };

  const plan = (o: Op, before: Map<number, Row>): Planned | undefined => {
    const none = new Map<number, bigint>();
    switch (o.kind) {
      case 'update':
      case 'upsert':
      case 'delete': {
        const f = fenceFor(o.fence, o.key);
        const fence = toFence(f);
        const write =
          o.kind === 'update'
            ? () => repo.update({ id: o.key }, fence, { stock: 1 })
            : o.kind === 'upsert'
              ? () => repo.upsert({ id: o.key, stock: 2 }, fence)
              : () => repo.delete({ id: o.key }, fence);
        return { write, palisade: { key: o.key, fence: f }, sets: none, refusable: false };
      }
      case 'purge':
        return { write: () => repo.purgeTombstones(new Date(Date.now() + 3_600_000)), sets: none, refusable: false };
      case 'set':
      case 'resurrect':
      case 'merge':
      case 'conflict':
      case 'rekey': {
        const row = before.get(o.key);
        if (o.kind === 'conflict' && !row) return undefined; // a plain INSERT of a new key: not guarded (README)
        const f = fenceFor(o.fence, o.key);
        const t = nameFor(o.key, o.via);
        const statement = {
          set: `update ${t} set stock = stock + 1, last_fence = ${f} where id = ${o.key}`,
          resurrect: `update ${t} set deleted_at = null, last_fence = ${f} where id = ${o.key} and deleted_at is not null`,
          merge: `merge into ${t} t using (select ${o.key} as k) s on t.id = s.k when matched then update set last_fence = ${f}`,
          conflict: `insert into ${t} (id, stock, last_fence) values (${o.key}, 3, ${f}) on conflict (id) do update set stock = excluded.stock, last_fence = excluded.last_fence`,
          rekey: `update ${t} set id = ${o.key + 1}, last_fence = ${f} where id = ${o.key}`,
        }[o.kind];
        const found = row !== undefined && (o.kind !== 'resurrect' || row.deleted);
        return {
          write: () => run(statement),
          sets: found ? new Map([[o.key, f]]) : none,
          // A key change, or a fence no higher than the row's, is refused whatever the triggers do.
          refusable: o.kind === 'rekey' || (found && f <= row.fence),
        };
      }
      case 'raise': {
        const row = before.get(o.key);
        return {
          write: () => run(`update ${nameFor(o.key, o.via)} set last_fence = last_fence + 1 where id = ${o.key}`),
          sets: row ? new Map([[o.key, row.fence + 1n]]) : none,
          refusable: false,
        };
      }
      case 'raise-all': {
        // Through the root, every row; through a partition, the first partition's.
        const t = nameFor(KEYS[0], o.via);
        const sets = new Map<number, bigint>();
        for (const [id, r] of before) if (nameFor(id, o.via) === t) sets.set(id, r.fence + 1n);
        return { write: () => run(`update ${t} set last_fence = last_fence + 1`), sets, refusable: false };
      }
      case 'erase':
        // A live row's delete is refused.
        return {
          write: () => run(`delete from ${nameFor(o.key, o.via)} where id = ${o.key}`),
          sets: none,
          refusable: true,
        };
      case 'erase-tombstones':
        return {
          write: () => run(`delete from ${nameFor(KEYS[0], o.via)} where deleted_at is not null`),
          sets: none,
          refusable: false,
        };
    }
  };

  observe(await rowsOf(db, root));
  for (const [step, o] of s.ops.entries()) {
    const at = `step ${step} (${JSON.stringify(o)})`;
    const before = await rowsOf(db, root);
    const floorBefore = await floorOf(db, root);
    const planned = plan(o, before);
    if (!planned) continue;
    const outcome = await planned.write().then(
      (value) => ({ ok: true as const, value }),
      (error: unknown) => ({ ok: false as const, error }),
    );
    const after = await rowsOf(db, root);
    const floor = await floorOf(db, root);
    if (!outcome.ok) {
      // Refused (by the trigger, a unique key, a partition's bounds): nothing of it stays.
      expect(outcome.error, at).toBeInstanceOf(DatabaseError);
      expect([after, floor], at).toEqual([before, floorBefore]);
      if (benign && !planned.refusable) throw new Error(`${at}: refused with triggers that only raise the fence`);
    } else {
      const p = planned.palisade;
      if (p) {
        const { status } = outcome.value as WriteResult<unknown>;
        if (p.fence <= (claims.get(p.key) ?? 0n)) expect(status, `${at}: a stale write`).not.toBe('applied');
        if (status === 'applied') claim(p.key, p.fence);
      }
      for (const [id, f] of planned.sets) claim(id, f);
    }
    observe(after);
    // Every claim stands, wherever the triggers moved the row: in the key's row, or in the floor.
    for (const [id, c] of claims) {
      const row = after.get(id);
      const standing = row ? row.fence : floor;
      if (standing < c)
        throw new Error(
          `${at}: key ${id} was written at ${c}, now holds ${standing} (${row ? 'its row' : 'the floor'})`,
        );
    }
  }
  // As a stale holder sees it: an upsert at each key's claim, the user's triggers off, does not apply.
  for (const [id, c] of claims) {
    expect(await probe(db, table, id, c), `key ${id} at ${c}`).not.toBe('applied');
  }
}

const ROLLBACK = new Error('rollback');

/**
 * An upsert at `fence` in a transaction that is rolled back, with every trigger off
 * (`session_replication_role = replica`): the status palisade's own statement reports.
 */
async function probe(db: Database, table: ReturnType<typeof gadgets>, id: number, fence: bigint): Promise<string> {
  let status = '';
  await db
    .transaction(async (tx) => {
      await execute(tx as unknown as Database, sql.raw('set local session_replication_role = replica'));
      const result = await fencedRepository(tx as unknown as Database, table).upsert({ id, stock: 9 }, toFence(fence));
      status = result.status;
      throw ROLLBACK;
    })
    .catch((e: unknown) => {
      if (e !== ROLLBACK) throw e;
    });
  return status;
}

const suites = [
  { name: 'pglite', open: () => pgliteDatabase({ migrated: true }), enabled: true },
  { name: 'postgres', open: () => postgresDatabase({ migrated: true }), enabled: needs('DATABASE_URL') },
];

for (const suite of suites) {
  describe.runIf(suite.enabled)(`fence trigger keys under the table's own triggers (${suite.name})`, () => {
    let test: TestDatabase;
    beforeAll(async () => {
      test = await suite.open();
    });
    afterAll(async () => {
      await test?.close();
    });

    it(
      "no key loses its fence, whatever the table's own BEFORE UPDATE triggers do to the row",
      async () => {
        await fc.assert(
          fc.asyncProperty(scenario, (s) => play(test.db, s)),
          propertyParams({ numRuns: propertyRuns(300) }),
        );
      },
      propertyTimeout(600_000),
    );
  });
}
