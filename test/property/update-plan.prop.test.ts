/**
 * A write of a planned shape (src/repo/update-plan.ts) decides exactly as
 * the full path does. Each run sends one arbitrary update — key, patch,
 * fence, `returning`, row or lock scope — twice: through a repository that
 * has just written that shape (so it takes the plan when it can) and
 * through a new repository (which has planned nothing, so it takes the full
 * path), each on a row of its own in the same starting state. Both must
 * give the same outcome (result or error: class, code, message) and leave
 * their rows alike; the queries the planned one sent must be the queries
 * the full path sent.
 *
 * On PGlite, one instance for the file. 1000 runs by default; see
 * ./support.ts for PALISADE_PROPERTY_RUNS and replaying a failure.
 */
import type { PGlite } from '@electric-sql/pglite';
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/pglite';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { newPglite } from '../support/pglite.js';
import { propertyParams, propertyTimeout } from './support.js';

// Plans belong to a table object: each repository below gets a table object of its own.
const itemsTable = () =>
  pgTable('plan_items', {
    id: text('id').primaryKey(),
    n: integer('n').notNull().default(0),
    label: text('label'),
    ...fenceColumns(),
  });
const items = itemsTable();

const signal = new AbortController().signal;

/** A key: the row's id, or something near it the full path refuses. */
const keyOf = fc.oneof(
  { weight: 6, arbitrary: fc.constant('plain') },
  { weight: 1, arbitrary: fc.constantFrom('extra', 'null', 'sql', 'missing', 'array', 'number') },
);
function key(kind: string, id: string): unknown {
  switch (kind) {
    case 'plain':
      return { id };
    case 'extra':
      return { id, n: 1 };
    case 'null':
      return { id: null };
    case 'sql':
      return { id: sql`${id}` };
    case 'missing':
      return {};
    case 'array':
      return [id];
    default:
      return 7;
  }
}

/** Patch entries: the table's columns and some it may not set, with values plain, null, undefined or SQL. */
const entry = fc.tuple(
  fc.constantFrom('n', 'label', 'id', 'lastFence', 'last_fence', 'deletedAt', 'nope', 'toString'),
  fc.oneof(
    fc.integer({ min: -5, max: 5 }),
    fc.string({ maxLength: 4 }),
    fc.constantFrom(null, undefined, '12', 1.5, true),
    fc.constant('sql'),
  ),
);
const patchShape = fc.oneof(
  { weight: 8, arbitrary: fc.array(entry, { maxLength: 4 }) },
  { weight: 1, arbitrary: fc.constantFrom('null', 'array', 'string') },
);
function patch(shape: [string, unknown][] | string): unknown {
  if (shape === 'null') return null;
  if (shape === 'array') return [1];
  if (typeof shape === 'string') return 'n = 1';
  const out: Record<string, unknown> = {};
  for (const [name, value] of shape) out[name] = value === 'sql' ? sql`${items.n} + 1` : value;
  return out;
}

/** What a call gave: the result, or the error as a user sees it. */
async function outcome(call: () => Promise<unknown>): Promise<unknown> {
  try {
    return { result: await call() };
  } catch (err) {
    const e = err as { constructor: { name: string }; code?: unknown; message?: unknown };
    return { error: e.constructor.name, code: e.code, message: e.message };
  }
}

describe('a planned update decides as the full path does', () => {
  let client: PGlite;
  let db: Database;
  const queries: string[] = [];

  beforeAll(async () => {
    client = newPglite();
    db = drizzle(client, { logger: { logQuery: (q) => queries.push(q) } }) as unknown as Database;
    await migrate(db);
    await execute(
      db,
      sql`create table plan_items (id text primary key, n integer not null default 0, label text,
        last_fence bigint not null default 0, deleted_at timestamptz)`,
    );
  }, 120_000);
  afterAll(async () => {
    await client?.close();
  });

  let run = 0;
  test.prop(
    [
      keyOf,
      patchShape,
      fc.constantFrom(99n, 100n, 101n),
      fc.constantFrom('row', 'status'),
      fc.constantFrom('row', 'lock'),
      fc.constantFrom('reject', 'allow'),
      fc.boolean(),
    ],
    propertyParams(),
  )(
    'same outcome, same rows, same queries',
    async (keyKind, shape, fence, returning, scope, sameFence, deleted) => {
      run++;
      const options = { sameFence: sameFence as 'reject' | 'allow' };
      const f = toFence(fence) as Fence;
      const opts = { returning: returning as 'row' | 'status' };
      // Each side has its lock (register at 100), its row, and two rows to write first: the first
      // write of a lock at a fence takes the full claim, later ones share the register (if the first
      // applied). `warm` writes them itself, and so plans their shape in both modes; the other side's
      // go through a repository of their own, so that `cold` has planned nothing.
      const side = async (name: string, primer: ReturnType<typeof fencedRepository<typeof items>>) => {
        const lock = Object.freeze({ kind: 'test', source: 'plan', namespace: 'plan', name: `${name}${run}` });
        const holder = { fence: f, signal, lock };
        await execute(
          db,
          sql`insert into palisade.lock_registers (kind, source, namespace, name, fence)
          values ('test', 'plan', 'plan', ${lock.name}, 100)`,
        );
        await execute(
          db,
          sql`insert into plan_items (id, n, label, last_fence, deleted_at) values
            (${`${name}${run}`}, 3, 'x', 100, ${deleted ? sql`now()` : null}),
            (${`${name}${run}a`}, 0, null, 0, null), (${`${name}${run}b`}, 0, null, 0, null)`,
        );
        const write = (repo: typeof primer, k: unknown, p: unknown) =>
          scope === 'lock'
            ? repo.with(holder).update(k as never, p as never, opts as never)
            : repo.update(k as never, f, p as never, opts as never);
        // Written first: the valid part of the patch (the columns it may set, in its order, an SQL
        // value as a plain one) by a valid key, so the plan the call below may take is there.
        const valid =
          typeof shape === 'string'
            ? shape
            : shape
                .filter(([n, v]) => (n === 'n' || n === 'label') && v !== undefined)
                .map(([n, v]): [string, unknown] => [n, v === 'sql' ? null : v]);
        for (const id of [`${name}${run}a`, `${name}${run}b`]) await outcome(() => write(primer, { id }, patch(valid)));
        const id = `${name}${run}`;
        return { id, write: (repo: typeof primer) => write(repo, key(keyKind, id), patch(shape)) };
      };
      const warm = fencedRepository(db, itemsTable(), options);
      const cold = fencedRepository(db, itemsTable(), options);
      const planned = await side('p', warm);
      const full = await side('f', fencedRepository(db, itemsTable(), options));

      queries.length = 0;
      const a = await outcome(() => planned.write(warm));
      const sentPlanned = queries.splice(0);
      const b = await outcome(() => full.write(cold));
      const sentFull = queries.splice(0);

      const rows = await execute(
        db,
        sql`select id, n, label, last_fence::text as f, deleted_at is not null as deleted from plan_items
          where id in (${planned.id}, ${full.id}) order by id desc`,
      );
      const [rowPlanned, rowFull] = rows.map(({ id: _, ...rest }) => rest);
      const tell = `key ${keyKind}, patch ${fc.stringify(shape)}, fence ${fence}, ${returning}, ${scope}, ${sameFence}, deleted ${deleted}`;
      // The two sides differ only in their ids, which are also their lock names.
      const same = (x: unknown, id: string) =>
        JSON.stringify(x, (_, v) => (typeof v === 'bigint' ? `${v}n` : v)).replaceAll(id, '<id>');
      expect(same(a, planned.id), tell).toBe(same(b, full.id));
      expect(rowPlanned, tell).toEqual(rowFull);
      expect(sentPlanned, tell).toEqual(sentFull);
    },
    propertyTimeout(60_000),
  );
});
