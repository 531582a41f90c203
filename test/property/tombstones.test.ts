/**
 * The life cycle of one row — live, deleted (a tombstone), purged — under
 * interleavings on a REAL Postgres, against the serial model of the write
 * semantics (README, "The write path"):
 *
 * - `update` / `modify` / `delete` write a live row whose fence is below
 *   theirs; on a tombstone or an absent row they report `missing` and write
 *   NOTHING (no fence moves: a write that found no row wrote nothing).
 * - `upsert` writes a live row or a tombstone whose fence is below its own
 *   (a tombstone comes back as a new row); an absent row only with a fence
 *   above the table's tombstone floor, else `stale` naming the floor.
 * - `stale` names the fence that refused the write; `duplicate` means this
 *   very fence already wrote this row.
 * - `purgeTombstones` removes tombstones and raises the floor to the highest
 *   fence it removed, in the same transaction.
 *
 * Every operation runs on a connection of its own. `fc.scheduler` decides
 * when each starts, and — for an update or delete that did not apply with
 * its first statement — when its second (refusal) statement runs: anything
 * may happen to the row between the two. Some operations are *blockers*: an explicit transaction
 * that holds the row (`FOR UPDATE`, an uncommitted delete or resurrection)
 * until the scheduler lets it commit or roll back, so the others queue on
 * the row lock. Before every scheduling decision the harness waits until
 * each running operation has either finished or is seen waiting on a lock in
 * `pg_stat_activity` (and records who blocks it): the runs really wait, and
 * the suite fails if none did.
 *
 * The same property runs on a hash-partitioned table, where old tombstones
 * of other keys share row positions (`ctid`) with the run's row in the
 * other partitions: it found a purge that matched rows by `ctid` alone
 * within 13 runs.
 *
 * Each operation goes through one of the table's names, chosen at random:
 * the bare name, the schema-qualified one and — on the partitioned table —
 * the partition that holds the row, or (a purge) another partition. A
 * floor kept per spelled name instead of per table lets a stale upsert
 * through one name re-create a row purged through another.
 *
 * With the fence trigger installed (partitioned table), an operator's plain
 * `DELETE` of the key (`erase`) joins them: alone, with a `DELETE` of a
 * bystander nested in it (a function its `WHERE` calls) or beside one in a
 * data-modifying CTE, each through any name; and the last partition stands
 * for one made after the install (no statement triggers of its own), so its
 * rows raise the floor row by row or leave their fences pending to an open
 * `DELETE` of the tree.
 *
 * The check: some serial order of the committed operations — one that
 * respects real time (an operation that finished before another started
 * comes first), puts a blocker before every operation seen waiting for it to
 * end while it held the row at the scheduler's gate,
 * and writes in the order an audit trigger recorded (commit order) —
 * produces exactly the observed results and the final row.
 */
import { fc } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { getTableConfig, integer, pgSchema, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres, { type Sql } from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute, int8 } from '../../src/driver.js';
import { RetryableWriteError } from '../../src/errors.js';
import { toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { WriteResult } from '../../src/repo/result.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { FENCE_TRIGGER_SQLSTATE, fenceTriggerStatements } from '../../src/schema/fence-trigger.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { propertyParams, propertyRuns, replaying } from './support.js';

const columns = () => ({
  id: text('id').primaryKey(),
  n: integer('n').notNull().default(0),
  v: text('v'),
  ...fenceColumns(),
});
const docs = pgTable('palisade_prop_tombs', columns());
type DocRow = typeof docs.$inferSelect;

/**
 * Which name an operation writes (or purges) the table through. The floor a
 * purge raises belongs to the table, so every route must see the same one:
 * - `name`: the bare name, resolved through the search path;
 * - `qualified`: `palisade_prop.palisade_prop_tombs`, the same table (every
 *   connection of the harness has `palisade_prop` first on its search path);
 * - `partition`: the partition that holds the run's key (partitioned layout);
 * - `sibling`: another partition (purges only): it removes bystanders and
 *   leaves the run's row alone.
 */
export type Route = 'name' | 'qualified' | 'partition' | 'sibling';
const PARTITIONS = 3;
const partitionName = (i: number) => `palisade_prop_tombs_p${i}`;
/** The harness's own schema, first on the search path of each of its connections. */
const SCHEMA = 'palisade_prop';
const qualifiedDocs = pgSchema(SCHEMA).table('palisade_prop_tombs', columns()) as unknown as typeof docs;
const partitionDocs = Array.from(
  { length: PARTITIONS },
  (_, i) => pgTable(partitionName(i), columns()) as unknown as typeof docs,
);
/** The table object for `route`, given the index of the partition that holds the run's key. */
function tableFor(route: Route, keyPartition: number): typeof docs {
  switch (route) {
    case 'name':
      return docs;
    case 'qualified':
      return qualifiedDocs;
    case 'partition':
      return partitionDocs[keyPartition] as typeof docs;
    case 'sibling':
      return partitionDocs[(keyPartition + 1) % PARTITIONS] as typeof docs;
  }
}

/** The SQL name of `route`'s table (see {@link tableFor}), for the erase operation's plain statement. */
function routeName(route: Route, keyPartition: number): string {
  const { schema, name } = getTableConfig(tableFor(route, keyPartition));
  return schema === undefined ? name : `${schema}.${name}`;
}

/**
 * Runs an erase (see {@link OpSpec.form}) on `client`; how many rows of the key it removed. Bystanders' ids
 * begin with `b_`.
 */
async function erase(
  client: Sql,
  { via = 'name', form = 'plain', other = 'name' }: OpSpec,
  keyPartition: number,
  key: string,
): Promise<number> {
  const table = routeName(via, keyPartition);
  const bystanders = routeName(other, keyPartition);
  const oneBystander = `(select id from ${bystanders} where left(id, 2) = 'b_' limit 1)`;
  switch (form) {
    case 'plain':
      return (await client.unsafe(`delete from ${table} where id = $1`, [key])).count;
    case 'cte':
      // The one-time filter reads the CTE, which runs (and opens its DELETE) before the key's is done.
      return (
        await client.unsafe(
          `with other as (delete from ${bystanders} where id = ${oneBystander} returning 1)
           delete from ${table} where id = $1 and (select count(*) from other) >= 0`,
          [key],
        )
      ).count;
    case 'nested': {
      // The function deletes the key from the outer DELETE's RETURNING, once it removed a bystander (its
      // statement triggers opened it); alone when no bystander is left. It keeps its count in a session
      // setting, read next.
      await client.unsafe(`select set_config('palisade_prop.erased', '-1', false)`);
      const eraseKey = `palisade_prop_erase_key('${table}', $1)`;
      const outer = await client.unsafe(`delete from ${bystanders} where id = ${oneBystander} returning ${eraseKey}`, [
        key,
      ]);
      if (outer.count === 0) await client.unsafe(`select ${eraseKey}`, [key]);
      const [row] = await client.unsafe(`select current_setting('palisade_prop.erased') as n`);
      return Number(row?.n);
    }
  }
}

const refusedByTrigger = (error: unknown) => (error as { code?: unknown })?.code === FENCE_TRIGGER_SQLSTATE;
/**
 * A nested or CTE erase deletes a bystander and the key in its own order, a purge in another: Postgres may
 * end either statement as a deadlock, which writes nothing (the audit and the final row check that).
 */
const deadlockedErase = (run: OpRun, error: unknown) =>
  run.spec.kind === 'erase' &&
  (run.spec.form ?? 'plain') !== 'plain' &&
  (error as { code?: unknown })?.code === '40P01';

/**
 * Plain operations run once, autocommit; blockers hold the row in a transaction until released.
 * `erase` is an operator's plain `DELETE … WHERE id = key`, not through palisade: only on a table with
 * the fence trigger, which refuses it on a live row and raises the floor when it removes a tombstone.
 */
export type OpKind = 'update' | 'upsert' | 'delete' | 'modify' | 'purge' | 'erase' | 'lock' | 'del' | 'res';
export interface OpSpec {
  readonly kind: OpKind;
  /** Relative fence 1…9 (the run adds a base above every earlier run's fences). */
  readonly fence: number;
  /** Blockers: commit (true) or roll back. */
  readonly commit: boolean;
  /** The name it goes through (`name` when absent). */
  readonly via?: Route;
  /**
   * An erase's statement (`plain` when absent): `nested` — a DELETE of a bystander tombstone through
   * `other`, whose RETURNING calls a function that deletes the key (a DELETE nested in it); `cte` — a
   * data-modifying CTE deletes a bystander through `other` first, in the same query. Either way the key
   * goes while another DELETE of its floor is open: one through the last partition (no statement triggers
   * of its own) leaves its fence pending to that DELETE's end.
   */
  readonly form?: EraseForm;
  /** The name the bystander's DELETE of a `nested` or `cte` erase goes through. */
  readonly other?: Route;
}
export type EraseForm = 'plain' | 'nested' | 'cte';
export interface Scenario {
  readonly init: { readonly state: 'absent' | 'live' | 'tomb'; readonly fence: number };
  readonly ops: readonly OpSpec[];
  /**
   * With the fence trigger: the key lives in the partition that stands for one made after the install
   * (else in another). An erase of it through that partition, nested in another DELETE or beside one in a
   * CTE, leaves its fence pending to the other's end.
   */
  readonly late?: boolean;
}

const MAX_OPS = 5;
const isBlocker = (k: OpKind) => k === 'lock' || k === 'del' || k === 'res';

/** Routes of a layout: a plain table has two names; a partition tree adds its partitions. */
const routesOf = (layout: TableLayout): Route[] =>
  layout === 'plain' ? ['name', 'qualified'] : ['name', 'qualified', 'partition', 'sibling'];

const opArb = (layout: TableLayout, trigger: boolean): fc.Arbitrary<OpSpec> =>
  fc
    .record({
      kind: fc.oneof(
        { weight: 3, arbitrary: fc.constantFrom<OpKind>('update', 'upsert', 'delete', 'modify') },
        { weight: 1, arbitrary: fc.constant<OpKind>('purge') },
        { weight: trigger ? 1 : 0, arbitrary: fc.constant<OpKind>('erase') },
        { weight: 2, arbitrary: fc.constantFrom<OpKind>('lock', 'del', 'res') },
      ),
      fence: fc.integer({ min: 1, max: 9 }),
      commit: fc.boolean(),
      via: fc.constantFrom(...routesOf(layout)),
      form: fc.constantFrom<EraseForm>('plain', 'nested', 'cte'),
      other: fc.constantFrom(...routesOf(layout)),
    })
    // Only a purge or an erase goes through a partition that does not hold the row; only an erase has a form.
    .map(({ form, other, ...op }) => ({
      ...op,
      ...(op.via === 'sibling' && !removes(op.kind) ? { via: 'partition' as const } : {}),
      ...(op.kind === 'erase' && form !== 'plain' ? { form, other } : {}),
    }));

/** The operations that remove rows: purge and erase. */
const removes = (k: OpKind) => k === 'purge' || k === 'erase';

export const scenarioArb = (layout: TableLayout, trigger = false): fc.Arbitrary<Scenario> =>
  fc.record({
    init: fc.record({
      state: fc.constantFrom('absent' as const, 'live' as const, 'tomb' as const),
      fence: fc.integer({ min: 1, max: 5 }),
    }),
    ops: fc.array(opArb(layout, trigger), { minLength: 2, maxLength: MAX_OPS }),
    late: trigger ? fc.boolean() : fc.constant(false),
  });

type Observed =
  | WriteResult<DocRow>
  | { status: 'error'; error: unknown }
  | { status: 'purged'; count: number }
  | { status: 'erased'; count: number }
  | { status: 'locked' };

interface OpRun {
  readonly index: number;
  readonly spec: OpSpec;
  readonly fence: bigint;
  readonly tag: string;
  start: number;
  end: number;
  result?: Observed;
  fnCalled?: boolean;
  /** Blockers: whether the transaction committed. */
  committed?: boolean;
  /** Indexes of blocker operations this one was seen waiting for. */
  readonly waitedFor: Set<number>;
}

interface AuditRow {
  readonly op: string;
  readonly fence: bigint;
  readonly deleted: boolean;
}

interface Outcome {
  readonly runs: OpRun[];
  readonly audit: AuditRow[];
  readonly final: { state: 'absent' | 'live' | 'tomb'; fence: bigint; n: number };
  readonly base: bigint;
  readonly waited: boolean;
  /** Some write ran its refusal statement: the scheduler could run others between its two statements. */
  readonly refused: boolean;
  /** Some write read its row again (it changed while the write waited): others could run before that read. */
  readonly reread: boolean;
}

/** One connection per operation slot, so `pg_stat_activity` tells which operation waits for which. */
interface Slot {
  readonly client: Sql;
  readonly db: Database;
  readonly pid: number;
  /** Awaited before the slot's client sends a refusal statement or a re-read (set by the run using the slot). */
  beforeRefusal?: (what: 'refusal statement' | 're-read') => Promise<void>;
}

export interface Harness {
  readonly mainClient: Sql;
  readonly main: Database;
  readonly probe: Sql;
  readonly slots: Slot[];
  nextBase: bigint;
  keySeq: number;
  readonly layout: TableLayout;
  /** The fence trigger is installed on the table (its floor trigger too): the erase operation runs. */
  readonly trigger: boolean;
  /**
   * `false` turns the refusal statement into a read only (its write CTE
   * selects nothing): what the repository would do if it did not try the
   * write again. Only for showing that the property catches it.
   */
  reattempt: boolean;
}

// The refusal statement of an update or delete: it reads the previous row and tries the write again.
const REFUSAL = /^with prev as \(.*\),\s*w as \((update .*? returning \*, true as palisade_applied)\)/s;
// The re-read of a write whose row changed while it waited (the row and, for an upsert, the floor).
const REREAD = /^select r\.fence, r\.deleted, /;

/**
 * The slot's postgres.js client, seen through a proxy that lets the run
 * pause between the write and its refusal statement or its re-read (and,
 * with `reattempt` off, strips the write out of the refusal statement).
 */
function pausingClient(client: Sql, slot: () => Slot, h: () => Harness): Sql {
  return new Proxy(client, {
    get(target, prop, receiver) {
      const value = Reflect.get(target, prop, receiver);
      if (prop !== 'unsafe') return value;
      return (query: string, params?: unknown[], options?: unknown) => {
        const match = REFUSAL.exec(query);
        const hook = slot().beforeRefusal;
        if (!hook || (!match && !REREAD.test(query))) return target.unsafe(query, params as never, options as never);
        const sent =
          !match || h().reattempt
            ? query
            : query.replace(
                match[1] as string,
                'select *, true as palisade_applied from palisade_prop_tombs where false',
              );
        return hook(match ? 'refusal statement' : 're-read').then(() =>
          target.unsafe(sent, params as never, options as never),
        );
      };
    },
  });
}

/**
 * `partitioned`: the table is hash-partitioned on its key into three
 * partitions, emptied before each run and filled with old tombstones of
 * other keys that sit in the other partitions at the same row positions
 * (`ctid`) as this run's row: what a purge must tell apart.
 */
export type TableLayout = 'plain' | 'partitioned';

export async function openHarness(
  test: TestDatabase,
  layout: TableLayout = 'plain',
  { trigger = false } = {},
): Promise<Harness> {
  await test.db.execute(sql.raw(`create schema if not exists ${SCHEMA}`));
  const connect = (max: number) =>
    postgres(test.url as string, { max, onnotice: () => {}, connection: { search_path: `${SCHEMA}, public` } });
  const mainClient = connect(2);
  const main = drizzle(mainClient) as unknown as Database;
  await migrate(main);
  const columns = sql`id text primary key, n integer not null default 0, v text,
      last_fence bigint not null default 0, deleted_at timestamptz`;
  if (layout === 'plain') await main.execute(sql`create table if not exists palisade_prop_tombs (${columns})`);
  else {
    await main.execute(sql`create table if not exists palisade_prop_tombs (${columns}) partition by hash (id)`);
    for (let i = 0; i < PARTITIONS; i++) {
      await main.execute(
        sql.raw(`create table if not exists ${partitionName(i)} partition of palisade_prop_tombs
          for values with (modulus ${PARTITIONS}, remainder ${i})`),
      );
    }
  }
  await main.execute(sql`create table if not exists palisade_prop_tombs_audit (
      seq bigserial primary key, key text not null, op text not null, fence bigint, deleted boolean)`);
  // Inside the writing statement, after the row lock: one key's audit order is its commit order.
  await main.execute(sql`create or replace function palisade_prop_tombs_audit() returns trigger language plpgsql as $$
      begin
        if tg_op = 'DELETE' then
          insert into palisade_prop_tombs_audit (key, op, fence, deleted) values (old.id, 'purge', old.last_fence, true);
          return old;
        end if;
        insert into palisade_prop_tombs_audit (key, op, fence, deleted)
          values (new.id, lower(tg_op), new.last_fence, new.deleted_at is not null);
        return new;
      end $$`);
  await main.execute(sql`drop trigger if exists audit on palisade_prop_tombs`);
  await main.execute(sql`create trigger audit after insert or update or delete on palisade_prop_tombs
      for each row execute function palisade_prop_tombs_audit()`);
  if (trigger) {
    for (const statement of fenceTriggerStatements({ schema: SCHEMA, name: 'palisade_prop_tombs' })) {
      await main.execute(sql.raw(statement));
    }
    // The last partition stands for one made after the install: without its own statement triggers, a DELETE
    // through its name raises the floor row by row, or leaves its rows' fences pending to a DELETE of the tree
    // that is open (a nested or CTE erase), whose end raises them.
    if (layout === 'partitioned') {
      for (const t of ['palisade_fence_floor', 'palisade_fence_floor_before'])
        await main.execute(sql.raw(`drop trigger ${t} on ${partitionName(PARTITIONS - 1)}`));
    }
    // A nested erase's function: deletes key `k` through the table named `t`, and keeps the count.
    await main.execute(sql`create or replace function palisade_prop_erase_key(t text, k text) returns boolean
      language plpgsql as $$ declare n int; begin
        execute format('delete from %s where id = $1', t) using k;
        get diagnostics n = row_count;
        perform set_config('palisade_prop.erased', n::text, false);
        return true;
      end $$`);
  }
  const probe = connect(1);
  const slots: Slot[] = [];
  const harness: Harness = {
    mainClient,
    main,
    probe,
    slots,
    nextBase: 0n,
    keySeq: 0,
    layout,
    trigger,
    reattempt: true,
  };
  for (let i = 0; i < MAX_OPS; i++) {
    const client = connect(1);
    const [row] = await client`select pg_backend_pid() as pid`;
    const db = drizzle(
      pausingClient(
        client,
        () => slots[i] as Slot,
        () => harness,
      ),
    ) as unknown as Database;
    slots.push({ client, db, pid: Number(row?.pid) });
  }
  return harness;
}

export async function closeHarness(h: Harness | undefined): Promise<void> {
  if (!h) return;
  await h.probe.end({ timeout: 5 });
  await h.mainClient.end({ timeout: 5 });
  for (const s of h.slots) await s.client.end({ timeout: 5 });
}

/**
 * Runs `scenario` under `s`. Each operation's start is a scheduled task, and
 * so is each blocker's release; before each release of a task the harness
 * waits (bounded) until every running operation is finished or waiting on a
 * lock.
 */
export async function play(h: Harness, s: fc.Scheduler, scenario: Scenario): Promise<Outcome> {
  const base = h.nextBase;
  h.nextBase += 100n;
  const stem = `k${process.pid}_${h.keySeq++}_${Date.now().toString(36)}`;
  // Fresh partitions: this run's row versions take the first row positions of their partition.
  if (h.layout === 'partitioned') await execute(h.main, sql`truncate palisade_prop_tombs`);
  // With the trigger, a key of the late partition or of another, as the scenario asks (of 64 candidates).
  const [{ k: key, i: keyPartition } = { k: stem, i: 0 }] = (
    h.layout === 'partitioned'
      ? await execute(
          h.main,
          h.trigger
            ? sql`select c.k, i from (select ${stem} || '_' || g as k, g from generate_series(1, 64) g) c,
                  generate_series(0, ${PARTITIONS - 1}) i
                where satisfies_hash_partition('palisade_prop_tombs'::regclass, ${PARTITIONS}, i, c.k)
                  and (i = ${PARTITIONS - 1}) = ${scenario.late === true}
                order by c.g limit 1`
            : sql`select ${stem} as k, i from generate_series(0, ${PARTITIONS - 1}) i
                where satisfies_hash_partition('palisade_prop_tombs'::regclass, ${PARTITIONS}, i, ${stem}::text)`,
        )
      : []
  ) as { k: string; i: number }[];
  if (scenario.init.state !== 'absent') {
    // Written before the trigger matters: the audit rows of the set-up carry op 'insert' and are skipped below.
    await execute(
      h.main,
      sql`insert into palisade_prop_tombs (id, n, v, last_fence, deleted_at)
          values (${key}, 0, 'init', ${base + BigInt(scenario.init.fence)},
                  ${scenario.init.state === 'tomb' ? sql`now() - interval '1 hour'` : sql`null`})`,
    );
  }
  if (h.layout === 'partitioned') {
    // Bystanders: old tombstones of other keys, about eight per partition, at the same row positions
    // (ctid) as this run's row in its own — a purge must remove them and nothing else. At fence `base`,
    // what the model's floor already stands at.
    await execute(
      h.main,
      sql`insert into palisade_prop_tombs (id, v, last_fence, deleted_at)
          select ${`b_${key}_`} || g, 'bystander', ${base}, now() - interval '2 hours' from generate_series(1, 24) g`,
    );
  }
  const [{ seq: auditFrom } = { seq: 0 }] = (await execute(
    h.main,
    sql`select coalesce(max(seq), 0) as seq from palisade_prop_tombs_audit`,
  )) as { seq: unknown }[];

  let clock = 0;
  let waited = false;
  let refused = false;
  let reread = false;
  const runs: OpRun[] = scenario.ops.map((spec, index) => ({
    index,
    spec,
    fence: base + BigInt(spec.fence),
    tag: `${spec.kind}#${index}`,
    start: Number.POSITIVE_INFINITY,
    end: Number.POSITIVE_INFINITY,
    waitedFor: new Set(),
  }));
  /** Operations whose statements are running (released by the scheduler, not finished). */
  const inFlight = new Set<number>();
  const pidToOp = new Map(h.slots.map((slot, i) => [slot.pid, i]));

  /** Waits until every running operation is finished or waiting on a lock; records who blocks whom. */
  async function settle(): Promise<void> {
    // Let the task just released mark itself running first (it does so in a microtask).
    await new Promise((resolve) => setImmediate(resolve));
    for (let i = 0; i < 300 && inFlight.size > 0; i++) {
      const pids = [...inFlight].map((op) => h.slots[op]?.pid as number);
      // A wait orders the two only when it is for the end of a blocker parked at its gate (holding what
      // it locked until the scheduler lets it end): a `transactionid` lock the waiter has not got. A
      // `tuple` lock is a place in the row's queue, which a later waiter may overtake; a wait on a
      // blocker still running was seen to end, the waiter writing, before that blocker did (cause not
      // established).
      const rows = await h.probe`select a.pid, a.state, a.wait_event_type, holder.pid as holder
          from pg_stat_activity a
          left join pg_locks w on w.pid = a.pid and w.locktype = 'transactionid' and not w.granted
          left join pg_locks holder on holder.locktype = 'transactionid' and holder.transactionid = w.transactionid
            and holder.granted and holder.pid <> a.pid
          where a.pid = any(${pids})`;
      const still = [...inFlight];
      const waiting = rows.filter((r) => r.wait_event_type === 'Lock' && r.state === 'active');
      for (const r of waiting) {
        const op = pidToOp.get(Number(r.pid));
        const blocker = r.holder === null ? undefined : pidToOp.get(Number(r.holder));
        if (op === undefined || !inFlight.has(op) || blocker === undefined || inFlight.has(blocker)) continue;
        if (isBlocker(scenario.ops[blocker]?.kind as OpKind)) runs[op]?.waitedFor.add(blocker);
      }
      // Stable when each operation still running is seen waiting on a lock.
      if (still.every((op) => !inFlight.has(op) || waiting.some((r) => pidToOp.get(Number(r.pid)) === op))) {
        if (waiting.length > 0) waited = true;
        return;
      }
      await sleep(3);
    }
  }

  async function runOp(run: OpRun): Promise<void> {
    const slot = h.slots[run.index] as Slot;
    const table = tableFor(run.spec.via ?? 'name', keyPartition);
    const repo = fencedRepository(slot.db, table);
    const fence = toFence(run.fence);
    const id = { id: key };
    // Between the two statements of a write that did not apply: not running, not waiting on a lock.
    slot.beforeRefusal = async (what) => {
      if (what === 'refusal statement') refused = true;
      else reread = true;
      inFlight.delete(run.index);
      await s.schedule(Promise.resolve(run.tag), `${what} of ${run.tag}`);
      inFlight.add(run.index);
    };
    await s.schedule(Promise.resolve(run.tag), `start ${run.tag} f${run.spec.fence} via ${run.spec.via ?? 'name'}`);
    inFlight.add(run.index);
    run.start = ++clock;
    const capture = async (fn: () => Promise<Observed>) => {
      try {
        run.result = await fn();
      } catch (error) {
        run.result = { status: 'error', error };
      }
    };
    try {
      switch (run.spec.kind) {
        case 'update':
          await capture(() => repo.update(id, fence, { v: run.tag }));
          break;
        case 'upsert':
          await capture(() => repo.upsert({ id: key, v: run.tag }, fence));
          break;
        case 'delete':
          await capture(() => repo.delete(id, fence));
          break;
        case 'modify':
          run.fnCalled = false;
          await capture(() =>
            repo.modify(id, fence, (row) => {
              run.fnCalled = true;
              return { n: row.n + 1, v: run.tag };
            }),
          );
          break;
        case 'purge':
          await capture(async () => ({
            status: 'purged',
            count: await repo.purgeTombstones(new Date(Date.now() + 3_600_000)),
          }));
          break;
        case 'erase':
          await capture(async () => ({
            status: 'erased',
            count: await erase(slot.client, run.spec, keyPartition, key),
          }));
          break;
        default: {
          // A blocker: its statement, then hold the transaction until the scheduler releases it.
          let held = false;
          try {
            await slot.db.transaction(async (tx) => {
              const txRepo = fencedRepository(tx as unknown as Database, table);
              if (run.spec.kind === 'lock') {
                await tx.execute(sql`select 1 from palisade_prop_tombs where id = ${key} for update`);
                run.result = { status: 'locked' };
              } else if (run.spec.kind === 'del') await capture(() => txRepo.delete(id, fence));
              else await capture(() => txRepo.upsert({ id: key, v: run.tag }, fence));
              inFlight.delete(run.index);
              held = true;
              await s.schedule(Promise.resolve(run.tag), `${run.spec.commit ? 'commit' : 'rollback'} ${run.tag}`);
              // Committing (or rolling back) runs until the transaction ends: later tasks see its outcome.
              inFlight.add(run.index);
              if (!run.spec.commit) tx.rollback();
            });
            run.committed = true;
          } catch (error) {
            if (!held) run.result = { status: 'error', error };
            run.committed = false;
          }
        }
      }
    } finally {
      run.end = ++clock;
      inFlight.delete(run.index);
      slot.beforeRefusal = undefined;
    }
  }

  const all = Promise.all(runs.map(runOp));
  await s.waitFor(all, async (pick) => {
    await settle();
    await pick();
  });

  const auditRows = await execute(
    h.main,
    sql`select op, fence, deleted from palisade_prop_tombs_audit where key = ${key} and seq > ${auditFrom} order by seq`,
  );
  const [row] = await execute(
    h.main,
    sql`select n, last_fence, deleted_at is not null as deleted from palisade_prop_tombs where id = ${key}`,
  );
  return {
    runs,
    base,
    waited,
    refused,
    reread,
    audit: auditRows.map((r) => ({ op: String(r.op), fence: int8(r.fence) ?? 0n, deleted: r.deleted === true })),
    final: row
      ? { state: row.deleted === true ? 'tomb' : 'live', fence: int8(row.last_fence) ?? 0n, n: Number(row.n) }
      : { state: 'absent', fence: 0n, n: 0 },
  };
}

// ---------------------------------------------------------------------------------------------
// The serial model.

interface ModelState {
  state: 'absent' | 'live' | 'tomb';
  fence: bigint;
  n: number;
  /** The table's tombstone floor, as far as this run can tell (fences of earlier runs are all below `base`). */
  floor: bigint;
}

type Expect =
  | { status: 'applied'; fence: bigint; n: number }
  | { status: 'erased'; count: number }
  | { status: 'refused by the trigger' }
  | { status: 'stale'; currentFence: bigint }
  | { status: 'duplicate' | 'missing' | 'none' };

/** One operation applied to the model (mode `reject`): its expected result and the audit rows it writes. */
function step(m: ModelState, run: OpRun): { expect: Expect; writes: AuditRow[] } {
  const f = run.fence;
  const kind = run.spec.kind;
  const refusal = (current: bigint): Expect =>
    current === f ? { status: 'duplicate' } : { status: 'stale', currentFence: current };
  switch (kind) {
    case 'lock':
      return { expect: { status: 'none' }, writes: [] };
    case 'purge':
      if (m.state !== 'tomb' || run.spec.via === 'sibling') return { expect: { status: 'none' }, writes: [] };
      if (m.fence > m.floor) m.floor = m.fence;
      m.state = 'absent';
      return { expect: { status: 'none' }, writes: [{ op: 'purge', fence: m.fence, deleted: true }] };
    case 'erase':
      if (m.state === 'live' && run.spec.via !== 'sibling')
        return { expect: { status: 'refused by the trigger' }, writes: [] };
      if (m.state !== 'tomb' || run.spec.via === 'sibling')
        return { expect: { status: 'erased', count: 0 }, writes: [] };
      // Its floor trigger raises the table's floor as a purge does.
      if (m.fence > m.floor) m.floor = m.fence;
      m.state = 'absent';
      return { expect: { status: 'erased', count: 1 }, writes: [{ op: 'purge', fence: m.fence, deleted: true }] };
    case 'update':
    case 'modify':
    case 'delete':
    case 'del': {
      if (m.state !== 'live') return { expect: { status: 'missing' }, writes: [] };
      if (m.fence >= f) return { expect: refusal(m.fence), writes: [] };
      m.fence = f;
      if (kind === 'modify') m.n += 1;
      if (kind === 'delete' || kind === 'del') m.state = 'tomb';
      return {
        expect: { status: 'applied', fence: f, n: m.n },
        writes: [{ op: 'update', fence: f, deleted: m.state === 'tomb' }],
      };
    }
    case 'upsert':
    case 'res': {
      if (m.state === 'absent') {
        if (m.floor >= f) return { expect: { status: 'stale', currentFence: m.floor }, writes: [] };
        Object.assign(m, { state: 'live', fence: f, n: 0 });
        return { expect: { status: 'applied', fence: f, n: 0 }, writes: [{ op: 'insert', fence: f, deleted: false }] };
      }
      if (m.fence >= f) return { expect: refusal(m.fence), writes: [] };
      // A tombstone comes back as a new row: n takes its default.
      if (m.state === 'tomb') m.n = 0;
      Object.assign(m, { state: 'live', fence: f });
      return { expect: { status: 'applied', fence: f, n: m.n }, writes: [{ op: 'update', fence: f, deleted: false }] };
    }
  }
}

function matches(run: OpRun, want: Expect, hasPurge: boolean): boolean {
  const got = run.result;
  if (!got) return false;
  if (run.spec.kind === 'purge') return got.status === 'purged';
  if (run.spec.kind === 'lock') return got.status === 'locked';
  if (got.status === 'error' && deadlockedErase(run, got.error)) return true;
  if (want.status === 'refused by the trigger') return got.status === 'error' && refusedByTrigger(got.error);
  if (want.status === 'erased') return got.status === 'erased' && got.count === want.count;
  // A write racing a purge may be told to retry; it wrote nothing (the audit and final row check that).
  if (got.status === 'error') return hasPurge && got.error instanceof RetryableWriteError;
  if (run.spec.kind === 'modify' && run.fnCalled !== (got.status === 'applied')) return false;
  switch (want.status) {
    case 'applied':
      return got.status === 'applied' && got.row.lastFence === want.fence && got.row.n === want.n;
    case 'stale':
      return got.status === 'stale' && got.currentFence === want.currentFence;
    case 'none':
      return false;
    default:
      return got.status === want.status;
  }
}

const sameAudit = (a: AuditRow | undefined, b: AuditRow) =>
  a !== undefined && a.op === b.op && a.fence === b.fence && a.deleted === b.deleted;

/**
 * Searches for a serial order of the committed operations that explains the
 * outcome. Returns `undefined` when one exists, else a description of the
 * closest attempt.
 */
export function explain(o: Outcome, scenario: Scenario): string | undefined {
  const committed = o.runs.filter((r) => !isBlocker(r.spec.kind) || r.committed === true);
  const hasPurge = scenario.ops.some((op) => removes(op.kind));
  for (const r of o.runs) {
    const expected =
      r.result?.status === 'error' &&
      ((r.spec.kind === 'erase' && refusedByTrigger(r.result.error)) || deadlockedErase(r, r.result.error));
    if (r.result?.status === 'error' && !expected && !(r.result.error instanceof RetryableWriteError)) {
      return `${r.tag}: unexpected error ${String(r.result.error)}`;
    }
  }
  const before = (a: OpRun, b: OpRun) => a.end < b.start || b.waitedFor.has(a.index);
  const initial: ModelState = {
    state: scenario.init.state,
    fence: scenario.init.state === 'absent' ? 0n : o.base + BigInt(scenario.init.fence),
    n: 0,
    floor: o.base,
  };
  let deepest = '';
  let depthSeen = -1;
  const search = (m: ModelState, placed: OpRun[], auditAt: number): boolean => {
    if (placed.length === committed.length) {
      const ok =
        auditAt === o.audit.length &&
        m.state === o.final.state &&
        (m.state === 'absent' || (m.fence === o.final.fence && m.n === o.final.n));
      if (!ok && placed.length >= depthSeen) {
        depthSeen = placed.length;
        deepest = `order ${placed.map((r) => r.tag).join(' → ')} leaves ${m.state} f${m.fence - o.base} n=${m.n}, audit ${auditAt}/${o.audit.length}`;
      }
      return ok;
    }
    for (const r of committed) {
      if (placed.includes(r)) continue;
      if (committed.some((q) => q !== r && !placed.includes(q) && before(q, r))) continue;
      const next = { ...m };
      const { expect: want, writes } = step(next, r);
      const errored = r.result?.status === 'error';
      let at = auditAt;
      let ok = matches(r, want, hasPurge);
      if (ok && !errored) {
        for (const w of writes) {
          if (!sameAudit(o.audit[at], w)) ok = false;
          at++;
        }
      }
      if (errored && ok) {
        // A retried write changed nothing: undo the model's step.
        Object.assign(next, m);
      }
      if (!ok) {
        if (placed.length >= depthSeen) {
          depthSeen = placed.length;
          deepest = `after ${placed.map((p) => p.tag).join(' → ') || '(start)'}: ${r.tag} f${r.spec.fence} expected ${JSON.stringify(want, (_, v) => (typeof v === 'bigint' ? `f${v - o.base}` : v))}`;
        }
        continue;
      }
      if (search(next, [...placed, r], at)) return true;
    }
    return false;
  };
  return search(initial, [], 0) ? undefined : deepest;
}

export function describeOutcome(o: Outcome, scenario: Scenario): string {
  const rel = (f: bigint) => `f${f - o.base}`;
  const lines = o.runs.map((r) => {
    const res = r.result;
    const detail =
      res === undefined
        ? '(no result)'
        : res.status === 'applied'
          ? `applied ${rel(res.row.lastFence)} n=${res.row.n}`
          : res.status === 'stale'
            ? `stale (current ${rel(res.currentFence)})`
            : res.status === 'error'
              ? `error ${String(res.error)}`
              : res.status === 'purged' || res.status === 'erased'
                ? `${res.status} ${res.count}`
                : res.status;
    const extra = [
      isBlocker(r.spec.kind) ? (r.committed ? 'committed' : 'rolled back') : '',
      r.fnCalled === undefined ? '' : `fn ${r.fnCalled ? 'called' : 'not called'}`,
      r.waitedFor.size > 0 ? `waited for ${[...r.waitedFor].map((i) => o.runs[i]?.tag).join(',')}` : '',
    ].filter(Boolean);
    return `  ${r.tag} f${r.spec.fence} via ${r.spec.via ?? 'name'} [${r.start}..${r.end}] → ${detail}${extra.length ? ` (${extra.join('; ')})` : ''}`;
  });
  const audit = o.audit.map((a) => `  ${a.op} ${rel(a.fence)}${a.deleted ? ' deleted' : ''}`);
  return [
    `initial: ${scenario.init.state} f${scenario.init.fence}`,
    ...lines,
    'audit (commit order):',
    ...audit,
    `final: ${o.final.state} ${o.final.state === 'absent' ? '' : `${rel(o.final.fence)} n=${o.final.n}`}`,
  ].join('\n');
}

/** Plays one scenario and throws with the whole story when no serial order explains it. */
export async function playAndCheck(h: Harness, s: fc.Scheduler, scenario: Scenario): Promise<Outcome> {
  const o = await play(h, s, scenario);
  const why = explain(o, scenario);
  if (why !== undefined) {
    throw new Error(`no serial order explains this run: ${why}\n${describeOutcome(o, scenario)}`);
  }
  return o;
}

/** The property: random scenarios under random schedules, each outcome checked against the serial model. */
async function searchInterleavings(h: Harness, numRuns: number): Promise<void> {
  let runs = 0;
  let waitedRuns = 0;
  let refusedRuns = 0;
  let rereadRuns = 0;
  // About one run in six queues on a row lock; on a loaded machine a short search (npm test runs a fraction of
  // the count) once saw none in 38. Then the search goes on with fresh seeds, every run still checked against
  // the model, at most three rounds in all; a replayed seed plays its one round.
  const rounds = replaying() ? 1 : 3;
  for (let round = 0; round < rounds && (round === 0 || waitedRuns === 0 || refusedRuns === 0); round++) {
    await fc.assert(
      fc.asyncProperty(fc.scheduler(), scenarioArb(h.layout, h.trigger), async (s, scenario) => {
        const o = await playAndCheck(h, s, scenario);
        runs++;
        if (o.waited) waitedRuns++;
        if (o.refused) refusedRuns++;
        if (o.reread) rereadRuns++;
      }),
      propertyParams({ numRuns: propertyRuns(numRuns) }),
    );
  }
  // The point of the blockers: statements really queued on a row lock in a good share of the runs.
  expect(waitedRuns, `runs that waited on a lock: ${waitedRuns} of ${runs}`).toBeGreaterThan(0);
  // And writes that did not apply at once gave the others a turn between their two statements.
  expect(refusedRuns, `runs with a refusal statement: ${refusedRuns} of ${runs}`).toBeGreaterThan(0);
  console.info(
    `tombstone model: ${waitedRuns} of ${runs} runs waited on a row lock, ${refusedRuns} paused between a write's two statements, ${rereadRuns} before a re-read`,
  );
}

describe.runIf(needs('DATABASE_URL'))(
  'tombstone life cycle under interleavings, partitioned table (real Postgres)',
  () => {
    let pg: TestDatabase;
    let h: Harness;
    beforeAll(async () => {
      pg = await postgresDatabase();
      h = await openHarness(pg, 'partitioned');
    });
    afterAll(async () => {
      await closeHarness(h);
      await pg?.close();
    });

    it('the same operations on a hash-partitioned table: every outcome is a serial one', async () => {
      await searchInterleavings(h, 100);
    }, 300_000);

    it('two purges of overlapping batches, through a partition and through the parent, do not deadlock', async () => {
      // Found by the property: both queue behind a lock on the run's row; once it is released, a purge
      // deleting in its plan's order deadlocked with the other (40P01) in about one replay in five.
      const ops: OpSpec[] = [
        { kind: 'purge', fence: 1, commit: true, via: 'sibling' },
        { kind: 'lock', fence: 1, commit: false },
        { kind: 'update', fence: 1, commit: true },
        { kind: 'update', fence: 1, commit: true },
        { kind: 'purge', fence: 1, commit: true },
      ];
      for (let i = 0; i < 12; i++) {
        const o = await playAndCheck(h, fc.schedulerFor([2, 4, 5, 1, 6, 7, 3, 8]), {
          init: { state: 'tomb', fence: 1 },
          ops,
        });
        expect(o.runs.map((r) => r.result?.status)).toEqual(['purged', 'locked', 'missing', 'missing', 'purged']);
      }
    }, 120_000);
  },
);

describe.runIf(needs('DATABASE_URL'))(
  'tombstone life cycle under interleavings, partitioned table with the fence trigger (real Postgres)',
  () => {
    let pg: TestDatabase;
    let h: Harness;
    beforeAll(async () => {
      pg = await postgresDatabase();
      h = await openHarness(pg, 'partitioned', { trigger: true });
    });
    afterAll(async () => {
      await closeHarness(h);
      await pg?.close();
    });

    it("an operator's plain DELETE beside palisade's writes and purges, through every name: every outcome is a serial one", async () => {
      await searchInterleavings(h, 200);
    }, 300_000);

    it.each([
      ['nested in a DELETE of a bystander through the parent', 'nested', 'name'],
      ['beside a CTE that deletes a bystander through another partition', 'cte', 'sibling'],
    ] as const)(
      "an erase of a late partition's tombstone %s: its pending fence keeps a lower one out",
      async (_how, form, other) => {
        // The key's partition has no statement triggers of its own (one made after the install): its row trigger
        // leaves the fence pending to the other DELETE, open meanwhile, whose end raises the floor to it.
        const scenario: Scenario = {
          init: { state: 'tomb', fence: 4 },
          late: true,
          ops: [
            { kind: 'erase', fence: 1, commit: true, via: 'partition', form, other },
            { kind: 'upsert', fence: 3, commit: true },
          ],
        };
        const o = await playAndCheck(h, fc.schedulerFor([1, 2]), scenario);
        expect(o.runs.map((r) => r.result)).toEqual([
          { status: 'erased', count: 1 },
          { status: 'stale', currentFence: o.base + 4n },
        ]);
      },
    );

    it("a plain DELETE of the tombstone through its partition's own name keeps a lower fence from recreating the row", async () => {
      // Found by the property: the floor trigger sat on the parent only, and a statement trigger fires only on
      // the table a statement names — the row came back at the erased tombstone's own fence.
      const scenario: Scenario = {
        init: { state: 'tomb', fence: 4 },
        ops: [
          { kind: 'erase', fence: 1, commit: true, via: 'partition' },
          { kind: 'upsert', fence: 4, commit: true },
        ],
      };
      const o = await playAndCheck(h, fc.schedulerFor([1, 2]), scenario);
      expect(o.runs.map((r) => r.result)).toEqual([
        { status: 'erased', count: 1 },
        { status: 'stale', currentFence: o.base + 4n },
      ]);
    });
  },
);

describe.runIf(needs('DATABASE_URL'))('tombstone life cycle under interleavings (real Postgres, fc.scheduler)', () => {
  let pg: TestDatabase;
  let h: Harness;
  beforeAll(async () => {
    pg = await postgresDatabase();
    h = await openHarness(pg);
  });
  afterAll(async () => {
    await closeHarness(h);
    await pg?.close();
  });

  it('update / upsert / delete / modify / purge with blockers on the row: every outcome is a serial one', async () => {
    await searchInterleavings(h, 150);
  }, 300_000);

  /**
   * The counterexamples the property found on the code before the write
   * semantics were fixed, replayed in a fixed order (task numbers: each
   * operation's start in list order, then each blocker's release).
   */
  describe('replays', () => {
    const replay = async (scenario: Scenario, order: number[]) => {
      const o = await playAndCheck(h, fc.schedulerFor(order), scenario);
      return o;
    };
    const op = (kind: OpKind, fence = 1, commit = true): OpSpec => ({ kind, fence, commit });

    it("an update that finds a tombstone writes nothing: the same holder's upsert then applies (not duplicate)", async () => {
      // Task 3: the refusal statement of the update / delete (modify decides on the row it locked).
      await replay({ init: { state: 'tomb', fence: 4 }, ops: [op('update', 7), op('upsert', 7)] }, [1, 3, 2]);
      await replay({ init: { state: 'tomb', fence: 4 }, ops: [op('modify', 7), op('upsert', 7)] }, [1, 2]);
      await replay({ init: { state: 'tomb', fence: 4 }, ops: [op('delete', 7), op('upsert', 7)] }, [1, 3, 2]);
    });

    it("a purge keeps what a stale fence must beat: a fence below the purged tombstone's cannot recreate the row", async () => {
      await replay({ init: { state: 'tomb', fence: 6 }, ops: [op('purge'), op('upsert', 5)] }, [1, 2]);
    });

    it('an upsert queued behind a purge of its tombstone does not recreate it with a lower fence', async () => {
      // The blocker holds the tombstone; the purge and then the upsert queue behind it; the blocker commits.
      const o = await replay(
        { init: { state: 'tomb', fence: 6 }, ops: [op('lock'), op('purge'), op('upsert', 5)] },
        [1, 2, 3, 4],
      );
      expect(o.waited).toBe(true);
      // The upsert waited for the tombstone, the purge removed it meanwhile: the upsert inserted, then its
      // fresh look at the floor refused (40001, retryable) — or it was refused outright. Never applied.
      const upsert = o.runs[2]?.result;
      if (upsert?.status === 'error') expect(upsert.error).toBeInstanceOf(RetryableWriteError);
      else expect(upsert).toEqual({ status: 'stale', currentFence: o.base + 6n });
      expect(o.final.state).toBe('absent');
      console.info(`upsert behind a purge: ${upsert?.status === 'error' ? 'retryable (40001)' : upsert?.status}`);
    });

    it('an update beside a concurrent resurrection: applied after it, or missing before it commits', async () => {
      // Task 3 commits the resurrection, task 4 is the update's refusal statement: here it runs first.
      const o = await replay({ init: { state: 'tomb', fence: 4 }, ops: [op('res', 6), op('update', 8)] }, [1, 2, 4, 3]);
      const [res, update] = o.runs;
      // Decided on the snapshot's tombstone (no wait, done before the commit), or on the new row after waiting.
      if (update?.result?.status === 'missing') expect(update.end).toBeLessThan(res?.end as number);
      else expect(update?.result?.status).toBe('applied');
    });

    it('an update whose row became writable between its two statements applies (the refusal statement tries again)', async () => {
      // 1 start res, 2 start update (sees the tombstone, writes nothing), 3 res commits, 4 the update's refusal statement.
      for (const kind of ['update', 'delete'] as const) {
        const scenario: Scenario = { init: { state: 'tomb', fence: 4 }, ops: [op('res', 6), op(kind, 8)] };
        const o = await replay(scenario, [1, 2, 3, 4]);
        expect(o.runs[1]?.result?.status).toBe('applied');
      }
    });

    it('the property catches a refusal statement that only reads', async () => {
      h.reattempt = false;
      try {
        const scenario: Scenario = { init: { state: 'tomb', fence: 4 }, ops: [op('res', 6), op('update', 8)] };
        await expect(playAndCheck(h, fc.schedulerFor([1, 2, 3, 4]), scenario)).rejects.toThrow(
          /no serial order explains this run/,
        );
      } finally {
        h.reattempt = true;
      }
    });

    it('blockers queued on one row may be seen waiting on each other: the check orders only waits for an end', async () => {
      // Blockers queued behind one that deletes at f8: the harness, counting every blocking pid, saw waits
      // pointing both ways, which no serial order satisfies. Searched: the queue's order is Postgres's.
      const scenarios: Scenario[] = [
        { init: { state: 'live', fence: 3 }, ops: [op('lock'), op('res', 5), op('del', 4), op('del', 8)] },
        { init: { state: 'live', fence: 3 }, ops: [op('res', 5), op('update', 1), op('del', 4), op('del', 8)] },
      ];
      let waited = 0;
      await fc.assert(
        fc.asyncProperty(fc.scheduler(), fc.constantFrom(...scenarios), async (s, scenario) => {
          if ((await playAndCheck(h, s, scenario)).waited) waited++;
        }),
        propertyParams({ numRuns: propertyRuns(300) }),
      );
      expect(waited).toBeGreaterThan(0);
    }, 120_000);

    it('an update waiting on a concurrent delete reports missing and writes nothing', async () => {
      const o = await replay({ init: { state: 'live', fence: 4 }, ops: [op('del', 6), op('update', 8)] }, [1, 2, 3, 4]);
      expect(o.waited).toBe(true);
      // The delete held the row at its gate: the update's wait for it orders the two.
      expect(o.runs[1]?.waitedFor.has(0)).toBe(true);
      expect(o.runs[1]?.result?.status).toBe('missing');
    });
  });
});
