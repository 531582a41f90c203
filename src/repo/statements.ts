/**
 * The SQL of every fenced write.
 *
 * `update` and `delete` are two statements (see {@link FencedWrite}): the
 * plain fenced write, which is all the success path sends, and — only when
 * it wrote nothing — a refusal statement that tries the same write again
 * and reads, beside it, the row as it was before (data-modifying CTEs and
 * their siblings share the statement's snapshot), so one round trip more
 * says why a write did not apply. Trying again is what keeps the outcome
 * serial: between the two statements the row may have become writable (a
 * resurrection committed, a blocker rolled back), and a refusal statement
 * that only read would then report a refusal no serial order explains.
 * `upsert` stays one statement (its success path already is one).
 *
 * Each write is decided by ONE row version: the write's own WHERE (or ON
 * CONFLICT … WHERE), which Postgres re-checks on the newest version after
 * waiting for a row lock. No sibling statement branches on the same row
 * (two siblings that split on `deleted_at` each see the snapshot, and after
 * a concurrent change the re-check can exclude the row from both). The
 * sibling that reads the previous row only explains a refusal; when it
 * cannot, the repository reads the row again (see `classify`).
 *
 * Plain values become placeholders, and so do the values inside SQL
 * expressions of a patch (see `templateOf`), so a statement's text depends
 * only on its shape and is compiled once and reused; see `shape`.
 */
import { type DriverValueEncoder, Param, type SQL, sql } from 'drizzle-orm';
import type { PgColumn } from 'drizzle-orm/pg-core';
import { type Claim, claimGuard, claimValues } from './claim-guard.js';
import { type ExpressionTemplate, templateOf } from './expressions.js';
import { type ClaimMode, cacheKeys, shape } from './statement-keys.js';
import { floorSql, isSql, type TableInfo } from './table.js';

/** `reject`: a fence writes a row at most once (`<`). `allow`: `<=`, for several writes per grant. */
export type SameFence = 'reject' | 'allow';

/** What an applied write sends back: the row as written, or only that it applied (the row count). */
export type Returning = 'row' | 'status';

/** A statement ready to compile, with the values for its placeholders. */
export interface Statement {
  /** Identifies the statement's text; `undefined` when an SQL value makes it one-off. */
  readonly key: string | undefined;
  readonly build: () => SQL;
  readonly values: Record<string, unknown>;
}

/**
 * A fenced write of one row (what it is: method, key, returning, claim) as
 * two statements over the same values.
 * `write` is the plain conditional write: one result row when it applied,
 * none when it did not (with `returning: 'status'`, no result rows: a row
 * count of 1 or 0). `refusal` runs only then: it attempts the very same
 * write again (it applies if the row became writable since) and reports the
 * row as it was before it, in exactly one result row. A lock-scoped `write`
 * also claims the lock's register; its `refusal` does not: it runs only in a
 * transaction that claimed the register first.
 */
export interface FencedWrite {
  readonly method: 'update' | 'delete';
  readonly key: Entries;
  readonly returning: Returning;
  /** How `write` claims the lock's register; `undefined` for a row-scoped write. */
  readonly claim: Claim | undefined;
  readonly write: Statement;
  readonly refusal: Statement;
}

type Entries = readonly (readonly [string, unknown])[];

// Result columns. Prefixed so they cannot collide with a user's column names.
export const APPLIED = 'palisade_applied';
export const PREV_FENCE = 'palisade_prev_fence';
export const PREV_DELETED = 'palisade_prev_deleted';
export const FLOOR = 'palisade_floor';

// Placeholder names of key (`k{i}`) and patch (`v{i}`) values, made once: a write of a planned shape
// (update-plan.ts) fills its values by these names without building a string.
const placeholderNames = (prefix: string) => Array.from({ length: 64 }, (_, i) => `${prefix}${i}`);
const KEY_NAMES = placeholderNames('k');
const VALUE_NAMES = placeholderNames('v');
/** @internal The placeholder of the `i`-th key value. */
export const keyPlaceholder = (i: number): string => KEY_NAMES[i] ?? `k${i}`;
/** @internal The placeholder of the `i`-th patch value (not inside an SQL expression). */
export const valuePlaceholder = (i: number): string => VALUE_NAMES[i] ?? `v${i}`;

const fenceParam = (info: TableInfo) => new Param(sql.placeholder('fence'), info.table.lastFence);
const cmp = (same: SameFence) => sql.raw(same === 'allow' ? '<=' : '<');
const bare = (column: PgColumn) => sql.identifier(column.name);

/** A placeholder encoded by `column`. */
function bind(values: Record<string, unknown>, name: string, value: unknown, column: PgColumn): SQL | Param {
  if (isSql(value)) return value;
  values[name] = value;
  return new Param(sql.placeholder(name), nullable(column));
}

// drizzle passes a placeholder's value to the column's encoder even when it
// is null: a timestamp's would throw, a json column's would store JSON `null`.
const nullable = (column: PgColumn): DriverValueEncoder<unknown, unknown> => ({
  mapToDriverValue: (value) => (value === null ? null : column.mapToDriverValue(value)),
});

function keyCondition(info: TableInfo, key: Entries, values: Record<string, unknown>): SQL {
  return sql.join(
    key.map(([name, value], i) => {
      const column = info.columns[name] as PgColumn;
      return sql`${column} = ${bind(values, keyPlaceholder(i), value, column)}`;
    }),
    sql` and `,
  );
}

/**
 * A patch's values as placeholders: plain values as `v{i}`, the values
 * inside an SQL expression as `v{i}_{j}` (see `templateOf`). `key` names the
 * statement shape the patch gives, `undefined` when an expression cannot be
 * a template (then the statement is compiled for this call only).
 */
interface PatchPlan {
  readonly assignments: (info: TableInfo) => SQL[];
  readonly key: string | undefined;
}

function patchPlan(info: TableInfo, patch: Entries, values: Record<string, unknown>): PatchPlan {
  const templates: (ExpressionTemplate | undefined)[] = [];
  let key: string | undefined = '';
  patch.forEach(([name, value], i) => {
    if (isSql(value)) {
      const template = templateOf(value, `v${i}`, values);
      templates[i] = template;
      key = key === undefined || !template ? undefined : `${key}${JSON.stringify(name)}=(${template.shape}),`;
    } else {
      values[valuePlaceholder(i)] = value;
      if (key !== undefined) key = `${key}${JSON.stringify(name)},`;
    }
  });
  const assignments = () =>
    patch.map(([name, value], i) => {
      const column = info.columns[name] as PgColumn;
      const template = templates[i];
      const set = template
        ? template.sql()
        : isSql(value)
          ? value
          : new Param(sql.placeholder(valuePlaceholder(i)), nullable(column));
      return sql`${bare(column)} = ${set}`;
    });
  return { assignments, key };
}

/**
 * The conditions under which a fenced write of one row lands: the key
 * matches, the row is live and its fence is below this one. Both statements
 * of a {@link FencedWrite} use exactly this.
 */
export function liveAndBelow(info: TableInfo, where: SQL, same: SameFence): SQL {
  const t = info.table;
  return sql`${where} and ${t.deletedAt} is null and ${t.lastFence} ${cmp(same)} ${fenceParam(info)}`;
}

/** Reads the row before the write and joins the write's RETURNING onto it: always exactly one result row. */
function withPrevious(info: TableInfo, where: SQL, write: SQL): SQL {
  const t = info.table;
  return sql`with prev as (select ${t.lastFence} as fence, ${t.deletedAt} is not null as deleted from ${t} where ${where}),
w as (${write})
select w.*, (select fence from prev) as ${sql.identifier(PREV_FENCE)}, (select deleted from prev) as ${sql.identifier(PREV_DELETED)}
from (select 1) as palisade_one left join w on true`;
}

const returningRow = sql.raw(` returning *, true as ${APPLIED}`);

/**
 * The two statements of a fenced single-row UPDATE whose SET is `set`: the
 * plain one returning what `returning` asks for, the refusal one always the
 * row (it is off the success path).
 */
function fencedWrite(
  info: TableInfo,
  method: 'update' | 'delete',
  key: Entries,
  set: (info: TableInfo) => SQL[],
  shapeKey: string | undefined,
  values: Record<string, unknown>,
  same: SameFence,
  returning: Returning,
  claim: Claim | undefined,
  mode: ClaimMode = claim === undefined ? 'none' : claim.shared ? 'shared' : 'claim',
): FencedWrite {
  const t = info.table;
  const update = (tail: SQL, guarded = false) => {
    const where = keyCondition(info, key, values);
    const assignments = [...set(info), sql`${bare(t.lastFence)} = ${fenceParam(info)}`];
    // Lock scope: the register is claimed by the row that is about to be written, as the last
    // condition (the function's COST puts it after the key and fence checks), so a write that
    // lands has claimed its lock in the same statement.
    const guard = guarded && mode !== 'none' ? sql` and ${claimGuard(fenceParam(info), mode === 'shared')}` : sql``;
    return {
      where,
      sql: sql`update ${t} set ${sql.join(assignments, sql`, `)}
  where ${liveAndBelow(info, where, same)}${guard}${tail}`,
    };
  };
  const keys = shapeKey === undefined ? undefined : cacheKeys(info, method, same, shapeKey, returning, mode);
  if (claim) claimValues(values, claim);
  fillKey(values, key);
  return {
    method,
    key,
    returning,
    claim,
    write: {
      key: keys?.write,
      // Status only: no RETURNING at all, the row count says whether it applied.
      build: () => update(returning === 'row' ? returningRow : sql``, true).sql,
      values,
    },
    refusal: {
      key: keys?.refusal,
      build: () => {
        const { where, sql: write } = update(returningRow);
        return withPrevious(info, where, write);
      },
      values,
    },
  };
}

/**
 * `UPDATE … SET patch, last_fence = $fence WHERE key AND live AND last_fence < $fence`.
 * A tombstone is not live: the update writes nothing there (no fence moves),
 * exactly as for a row that does not exist.
 */
export function updateStatements(
  info: TableInfo,
  key: Entries,
  patch: Entries,
  fence: bigint,
  same: SameFence,
  returning: Returning = 'row',
  claim?: Claim,
): FencedWrite {
  const values: Record<string, unknown> = { fence };
  const plan = patchPlan(info, patch, values);
  return fencedWrite(info, 'update', key, plan.assignments, plan.key, values, same, returning, claim);
}

/**
 * The plain write of an update that sets the columns `patch` (their keys,
 * in order) to plain values: its cache key and its text, for the plan of
 * that shape (update-plan.ts), which fills the placeholders on each call —
 * `fence`, the key's `k{i}`, the patch's `v{i}` and, lock-scoped, the
 * claim's. The same key and text as {@link updateStatements} gives a write
 * of that shape.
 */
export function plainUpdateStatement(
  info: TableInfo,
  patch: readonly string[],
  same: SameFence,
  returning: Returning,
  mode: ClaimMode,
): { readonly key: string | undefined; readonly build: () => SQL } {
  // Placeholders only: the builder records values here, none of them is ever sent.
  const values: Record<string, unknown> = {};
  const key = info.keyNames.map((name) => [name, null] as const);
  const plan = patchPlan(
    info,
    patch.map((name) => [name, null] as const),
    values,
  );
  const w = fencedWrite(info, 'update', key, plan.assignments, plan.key, values, same, returning, undefined, mode);
  return { key: w.write.key, build: w.write.build };
}

/** Marks a live row deleted: a tombstone that keeps the fence. A tombstone is not live: nothing is written. */
export function deleteStatements(
  info: TableInfo,
  key: Entries,
  fence: bigint,
  same: SameFence,
  claim?: Claim,
): FencedWrite {
  const values: Record<string, unknown> = { fence };
  const set = (i: TableInfo) => [sql`${bare(i.table.deletedAt)} = now()`];
  return fencedWrite(info, 'delete', key, set, '', values, same, 'row', claim);
}

/**
 * `INSERT … ON CONFLICT (key) DO UPDATE SET … WHERE last_fence < excluded.last_fence`.
 * Clears a tombstone only for a fence above the one that deleted the row.
 * Columns not in `row` keep their values on a live row and take their
 * defaults on a resurrected one.
 *
 * A row that does not exist is created only by a fence above the table's
 * tombstone floor (`palisade.tombstone_floors`, raised by purges): the insert
 * is not even attempted when the row is absent from the snapshot and the
 * floor refuses the fence. A purge that commits while the statement runs is
 * invisible to the snapshot, so a row the statement newly inserted is checked
 * again with a fresh snapshot (`palisade.check_tombstone_floor`, 40001 when it
 * refuses). "Newly inserted" is not `xmax = 0` (refused in a partitioned
 * table's RETURNING): the insert's SELECT sets the transaction-local
 * `palisade.upsert` to `insert`, the conflict branch's WHERE to `update`.
 */
export function upsertStatement(
  info: TableInfo,
  key: Entries,
  row: Entries,
  fence: bigint,
  same: SameFence,
): Statement {
  const values: Record<string, unknown> = { fence };
  const t = info.table;
  const build = () => {
    const where = keyCondition(info, key, values);
    const columns = row.map(([name]) => info.columns[name] as PgColumn);
    const inserted = row.map(([name, value], i) =>
      bind(values, valuePlaceholder(i), value, info.columns[name] as PgColumn),
    );
    const keyColumns = info.keyNames.map((name) => bare(info.columns[name] as PgColumn));
    const updates = columns
      .filter((c) => !info.keyNames.some((k) => info.columns[k] === c))
      .map((c) => sql`${bare(c)} = excluded.${bare(c)}`);
    // A resurrected tombstone is a new row: columns not given take their defaults, not the deleted values.
    const given = new Set(row.map(([name]) => name));
    for (const [name, c] of Object.entries(info.columns)) {
      if (given.has(name) || c === t.lastFence || c === t.deletedAt || c.generated || c.generatedIdentity) continue;
      updates.push(sql`${bare(c)} = case when ${t.deletedAt} is null then ${c} else excluded.${bare(c)} end`);
    }
    updates.push(sql`${bare(t.lastFence)} = excluded.${bare(t.lastFence)}`, sql`${bare(t.deletedAt)} = null`);
    const allowEqual = sql.raw(same === 'allow' ? 'true' : 'false');
    return sql`with prev as (select ${t.lastFence} as fence, ${t.deletedAt} is not null as deleted from ${t} where ${where}),
floor as (select coalesce(${floorSql(info)}, 0) as fence),
w as (insert into ${t} (${sql.join([...columns.map(bare), bare(t.lastFence), bare(t.deletedAt)], sql`, `)})
  select ${sql.join([...inserted, fenceParam(info), sql`null`], sql`, `)}
  where set_config('palisade.upsert', 'insert', true) is not null
    and (exists (select 1 from prev) or (select fence from floor) ${cmp(same)} ${fenceParam(info)})
  on conflict (${sql.join(keyColumns, sql`, `)}) do update set ${sql.join(updates, sql`, `)}
  where ${t.lastFence} ${cmp(same)} excluded.${bare(t.lastFence)} and set_config('palisade.upsert', 'update', true) is not null
  returning *, true as ${sql.identifier(APPLIED)},
    case when current_setting('palisade.upsert', true) = 'insert'
      then palisade.check_tombstone_floor(${info.regclass}, ${fenceParam(info)}, ${allowEqual}) end as palisade_floor_checked)
select w.*, (select fence from prev) as ${sql.identifier(PREV_FENCE)}, (select deleted from prev) as ${sql.identifier(PREV_DELETED)},
  (select fence from floor) as ${sql.identifier(FLOOR)}
from (select 1) as palisade_one left join w on true`;
  };
  fillKey(values, key);
  row.forEach(([, value], i) => {
    if (!isSql(value)) values[valuePlaceholder(i)] = value;
  });
  return { key: shape('upsert', info, same, row), build, values };
}

/**
 * Fenced update of every live row matching `where`, counting rows applied
 * and refused. With `allOrNothing` the matching rows are locked first and
 * nothing is written if any of them is at or above the fence.
 */
export function updateWhereStatement(
  info: TableInfo,
  where: SQL,
  patch: Entries,
  fence: bigint,
  same: SameFence,
  allOrNothing: boolean,
): Statement {
  const values: Record<string, unknown> = { fence };
  const t = info.table;
  const keyColumns = info.keyNames.map((name) => info.columns[name] as PgColumn);
  const assignments = [
    ...patchPlan(info, patch, values).assignments(info),
    sql`${bare(t.lastFence)} = ${fenceParam(info)}`,
  ];
  const guard = allOrNothing
    ? sql` and not exists (select 1 from target where not (target.palisade_fence ${cmp(same)} ${fenceParam(info)}))`
    : sql``;
  // Locked, the targets' fences are current: count those that stopped the batch. Unlocked, a row
  // a concurrent writer raised (or deleted) is refused though it looked writable: count what did
  // not apply. The update re-checks `deleted_at` on the row it waited for, so it never writes a
  // tombstone.
  const stale = allOrNothing
    ? sql`(select count(*) from target where not (target.palisade_fence ${cmp(same)} ${fenceParam(info)}))`
    : sql`(select count(*) from target) - (select count(*) from w)`;
  const query = sql`with target as (select ${sql.join(keyColumns, sql`, `)}, ${t.lastFence} as palisade_fence from ${t}
  where (${where}) and ${t.deletedAt} is null${allOrNothing ? sql` for update` : sql``}),
w as (update ${t} set ${sql.join(assignments, sql`, `)}
  where (${sql.join(keyColumns, sql`, `)}) in (select ${sql.join(keyColumns.map(bare), sql`, `)} from target)
  and ${t.deletedAt} is null and ${t.lastFence} ${cmp(same)} ${fenceParam(info)}${guard} returning 1)
select (select count(*) from w) as applied, ${stale} as stale`;
  // `where` is caller SQL with its own inline parameters: never cached.
  return { key: undefined, build: () => query, values };
}

// Placeholder values must exist even when the cached text is reused and
// `build` (which records them) does not run.
function fillKey(values: Record<string, unknown>, key: Entries): void {
  key.forEach(([, value], i) => {
    values[keyPlaceholder(i)] = value;
  });
}
