/**
 * search-index-rebuild — an efficiency lock for an expensive rebuild.
 *
 * The story. Rebuilding the product-search index is expensive (minutes).
 * It runs on a schedule and an admin can trigger it by hand, on any worker
 * of the fleet. Two rebuilds at once would waste a lot and could leave a
 * half-written index; a worker can crash in the middle of one.
 *
 * Efficiency or correctness? Classify first. The rebuild writes into a
 * fresh table and swaps it in atomically at the end, so two overlapping
 * rebuilds are *wasteful*, not corrupting: this is an efficiency lock — a
 * lease with a TTL and a watchdog (the lease is extended every ttl/3 while
 * the worker is alive, so a minutes-long job keeps it; a crashed worker
 * stops extending and the lock frees one TTL later). One write still
 * matters: the swap. It is conditional on the lease's fence (a fenced write
 * of the index's metadata row, in the swap's transaction), so a worker that
 * lost its lease mid-rebuild — paused, then resumed — can never swap in its
 * older build over a newer one.
 *
 * Idempotency is the safety net: each run builds into a table named after
 * its fence, first dropping whatever a crashed run left behind (it holds the
 * lock, so no live run owns those), and the live index is only ever
 * replaced whole. A crash leaves the old index serving; the next run redoes
 * the rebuild cleanly.
 *
 * And the admin who clicks "rebuild" while one is running gets an answer at
 * once — `tryAcquire` never waits — saying who is rebuilding since when:
 * "a rebuild is already running (started … by …)".
 *
 * Run it:
 *
 *   DATABASE_URL=postgres://… npx tsx examples/search-index-rebuild/index.ts
 *   (and again in another terminal while the first runs)
 */
import { parseArgs } from 'node:util';
import { and, asc, count, eq, gt, like, sql } from 'drizzle-orm';
import { integer, pgSchema, pgTable, primaryKey, text, timestamp } from 'drizzle-orm/pg-core';
import {
  type Database,
  type Fence,
  fenceColumns,
  fencedRepository,
  type LockManager,
  migrate,
  postgresLockManager,
} from 'palisade-db';
import { connectFromEnv, createTables, holderLabel, isMain, logEvents } from '../shared.js';

export const products = pgTable('products', {
  id: integer('id').primaryKey(),
  name: text('name').notNull(),
  description: text('description').notNull(),
});

/** What the live index is: which build, by whom, when. The swap writes it with the fence. */
export const indexMeta = pgTable('search_index_meta', {
  id: integer('id').primaryKey(),
  builtAt: timestamp('built_at', { withTimezone: true }).notNull(),
  builtBy: text('built_by').notNull(),
  terms: integer('terms').notNull(),
  ...fenceColumns(),
});

/** An index table: the live one, or a build of one run (same columns, another name). */
const indexTable = (name: string) =>
  pgTable(name, { term: text('term').notNull(), productId: integer('product_id').notNull() }, (t) => [
    primaryKey({ columns: [t.term, t.productId] }),
  ]);

const LIVE = 'search_index';
export const searchIndex = indexTable(LIVE);
const pgTables = pgSchema('pg_catalog').table('pg_tables', {
  schemaname: text('schemaname'),
  tablename: text('tablename'),
});
const BUILD_PREFIX = 'search_index_build_';
const LOCK = 'search-index-rebuild';

/** Creates the tables (palisade's too), an empty live index and a small catalogue, if not there yet. */
export async function setup(db: Database): Promise<void> {
  await migrate(db);
  await createTables(db, [
    sql`create table if not exists products (id integer primary key, name text not null, description text not null)`,
    sql`create table if not exists search_index (term text not null, product_id integer not null, primary key (term, product_id))`,
    sql`create table if not exists search_index_meta (id integer primary key, built_at timestamptz not null,
      built_by text not null, terms integer not null, last_fence bigint not null default 0, deleted_at timestamptz)`,
  ]);
  const adjectives = ['red', 'blue', 'quiet', 'fast', 'sturdy', 'tiny'];
  const things = ['kettle', 'lamp', 'bicycle', 'teapot', 'drill', 'umbrella', 'tent'];
  await db
    .insert(products)
    .values(
      Array.from({ length: 42 }, (_, i) => ({
        id: i + 1,
        name: `${adjectives[i % adjectives.length]} ${things[i % things.length]}`,
        description: `item ${i + 1}: a ${adjectives[(i + 2) % adjectives.length]} one`,
      })),
    )
    .onConflictDoNothing();
}

export type RebuildEvent =
  | { type: 'already-running'; message: string }
  | { type: 'started'; fence: Fence; table: string }
  | { type: 'cleaned'; tables: string[] }
  | { type: 'progress'; products: number }
  | { type: 'swapped'; terms: number }
  | { type: 'superseded'; reason: string };

export interface RebuildOptions {
  readonly db: Database;
  readonly locks: LockManager;
  /** Lease TTL; the watchdog extends it every ttl/3 while this worker runs (default 30 s). */
  readonly ttlMs?: number;
  /** Products indexed per statement (default 10). */
  readonly batchSize?: number;
  /** Awaited after each step: log it, or (in tests) hold the rebuild at a chosen point. */
  readonly onEvent?: (event: RebuildEvent) => void | Promise<void>;
}

export type RebuildResult =
  | { readonly status: 'rebuilt'; readonly terms: number; readonly fence: string }
  | { readonly status: 'already-running'; readonly message: string }
  | { readonly status: 'superseded'; readonly reason: string };

/**
 * Rebuilds the search index, or answers at once that a rebuild is already
 * running (scheduled run and admin trigger alike). Guarantees: the live
 * index is replaced whole, atomically, and only by the run holding the
 * newest fence; a crashed run's leftovers are cleaned by the next run. Does
 * not: guarantee that no two builds ever overlap (a paused worker can keep
 * building after its lease expired — it wastes work, and its swap is
 * refused), or resume a crashed build (it starts over).
 */
export async function rebuildSearchIndex(options: RebuildOptions): Promise<RebuildResult> {
  const { db, locks } = options;
  const emit = async (event: RebuildEvent) => options.onEvent?.(event);
  const batchSize = options.batchSize ?? 10;
  const lease = await locks.tryAcquire(LOCK, {
    ttlMs: options.ttlMs ?? 30_000,
    autoExtend: true,
    holder: holderLabel('search-index'),
  });
  if (!lease) {
    const info = await locks.inspect(LOCK);
    const since = info?.acquiredAt ? info.acquiredAt.toISOString() : 'a moment ago';
    const message = info
      ? `a rebuild is already running (started ${since} by ${info.holder ?? 'an unnamed worker'}, fence ${info.fence})`
      : 'a rebuild is already running (it is finishing now)';
    await emit({ type: 'already-running', message });
    return { status: 'already-running', message };
  }
  const build = `${BUILD_PREFIX}${lease.fence}`;
  try {
    await emit({ type: 'started', fence: lease.fence, table: build });
    // We hold the lock: any build table left is a crashed (or superseded) run's.
    const leftovers = await db
      .select({ name: pgTables.tablename })
      .from(pgTables)
      .where(and(eq(pgTables.schemaname, sql`current_schema()`), like(pgTables.tablename, `${BUILD_PREFIX}%`)));
    const names = leftovers.map((r) => String(r.name));
    for (const name of names) await db.execute(sql`drop table if exists ${sql.identifier(name)}`);
    await emit({ type: 'cleaned', tables: names });

    await db.execute(
      sql`create table ${sql.identifier(build)} (term text not null, product_id integer not null, primary key (term, product_id))`,
    );
    let after = 0;
    let indexed = 0;
    // Bounded: one pass over the products, by id.
    for (;;) {
      if (lease.signal.aborted) return await supersede(build, 'the lease was lost during the build');
      const batch = await db
        .select({ id: products.id })
        .from(products)
        .where(gt(products.id, after))
        .orderBy(asc(products.id))
        .limit(batchSize);
      if (batch.length === 0) break;
      const ids = batch.map((p) => p.id);
      await db.execute(sql`insert into ${sql.identifier(build)} (term, product_id)
        select distinct w, p.id from products p,
          regexp_split_to_table(lower(p.name || ' ' || p.description), '[^a-z0-9]+') as w
        where w <> '' and p.id = any(${sql.param(ids)}::int[])
        on conflict do nothing`);
      after = ids[ids.length - 1] as number;
      indexed += ids.length;
      await emit({ type: 'progress', products: indexed });
    }

    // The swap: one transaction, conditional on the fence.
    const terms = await db.transaction(async (tx) => {
      const [counted] = await tx.select({ n: count() }).from(indexTable(build));
      const written = await fencedRepository(tx, indexMeta).upsert(
        { id: 1, builtAt: new Date(), builtBy: holderLabel('search-index'), terms: counted?.n ?? 0 },
        lease.fence,
      );
      if (written.status !== 'applied') return null; // a newer run has swapped: keep its index
      const old = `search_index_old_${lease.fence}`;
      await tx.execute(sql`alter table ${sql.identifier(LIVE)} rename to ${sql.identifier(old)}`);
      await tx.execute(sql`alter table ${sql.identifier(build)} rename to ${sql.identifier(LIVE)}`);
      await tx.execute(sql`drop table ${sql.identifier(old)}`);
      return counted?.n ?? 0;
    });
    if (terms === null) return await supersede(build, 'a newer rebuild has already swapped its index in');
    await emit({ type: 'swapped', terms });
    return { status: 'rebuilt', terms, fence: String(lease.fence) };
  } catch (err) {
    // A run that lost its lease may find its build table dropped by the next run.
    if (lease.signal.aborted) return await supersede(build, `the lease was lost (${(err as Error).message})`);
    throw err;
  } finally {
    await lease.release();
  }

  async function supersede(table: string, reason: string): Promise<RebuildResult> {
    await db.execute(sql`drop table if exists ${sql.identifier(table)}`).catch(() => {});
    await emit({ type: 'superseded', reason });
    return { status: 'superseded', reason };
  }
}

/** Products whose name or description contains `term` (the live index). */
export async function search(db: Database, term: string): Promise<number[]> {
  const rows = await db
    .select({ id: searchIndex.productId })
    .from(searchIndex)
    .where(eq(searchIndex.term, term.toLowerCase()))
    .orderBy(asc(searchIndex.productId));
  return rows.map((r) => r.id);
}

if (isMain(import.meta.url)) {
  const { values } = parseArgs({ options: { 'ttl-ms': { type: 'string' }, 'batch-size': { type: 'string' } } });
  const { db, close } = connectFromEnv('search-index-rebuild');
  const locks = postgresLockManager({ client: db, namespace: 'examples' });
  try {
    await setup(db);
    const result = await rebuildSearchIndex({
      db,
      locks,
      ttlMs: Number(values['ttl-ms'] ?? 30_000),
      batchSize: Number(values['batch-size'] ?? 10),
      onEvent: async (event) => {
        logEvents('search-index')(event);
        // Slow enough to try the admin trigger from another terminal.
        if (event.type === 'progress') await new Promise((resolve) => setTimeout(resolve, 1000));
      },
    });
    console.log(
      `[search-index ${process.pid}] ${result.status === 'already-running' ? result.message : result.status}`,
    );
  } finally {
    await locks.close();
    await close();
  }
}
