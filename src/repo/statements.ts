/**
 * The SQL of every fenced write. Each is ONE statement: the write itself
 * plus a sibling CTE that reads the row as it was before the statement, so
 * the same round trip says why a write did not apply (data-modifying CTEs
 * and their siblings share the statement's snapshot).
 *
 * Each write is decided by ONE row version: the write's own WHERE (or ON
 * CONFLICT … WHERE), which Postgres re-checks on the newest version after
 * waiting for a row lock. No sibling statement branches on the same row
 * (two siblings that split on `deleted_at` each see the snapshot, and after
 * a concurrent change the re-check can exclude the row from both). The
 * sibling that reads the previous row only explains a refusal; when it
 * cannot, the repository reads the row again (see `classify`).
 *
 * Plain values become placeholders, so a statement's text depends only on
 * its shape (which columns, which of them are SQL expressions) and can be
 * compiled once and reused; see `statementKey`.
 */
import { type DriverValueEncoder, Param, type SQL, sql } from 'drizzle-orm';
import type { PgColumn } from 'drizzle-orm/pg-core';
import { isSql, type TableInfo } from './table.js';

/** `reject`: a fence writes a row at most once (`<`). `allow`: `<=`, for several writes per grant. */
export type SameFence = 'reject' | 'allow';

/** A statement ready to compile, with the values for its placeholders. */
export interface Statement {
  /** Identifies the statement's text; `undefined` when an SQL value makes it one-off. */
  readonly key: string | undefined;
  readonly build: () => SQL;
  readonly values: Record<string, unknown>;
}

type Entries = readonly (readonly [string, unknown])[];

// Result columns. Prefixed so they cannot collide with a user's column names.
export const APPLIED = 'palisade_applied';
export const PREV_FENCE = 'palisade_prev_fence';
export const PREV_DELETED = 'palisade_prev_deleted';
export const FLOOR = 'palisade_floor';

const fenceParam = (info: TableInfo) => new Param(sql.placeholder('fence'), info.table.lastFence);
const cmp = (same: SameFence) => sql.raw(same === 'allow' ? '<=' : '<');
const bare = (column: PgColumn) => sql.identifier(column.name);

/** A placeholder encoded by `column`, or the SQL expression itself. */
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

function shape(method: string, info: TableInfo, same: SameFence, entries: Entries): string | undefined {
  if (entries.some(([, v]) => isSql(v))) return undefined;
  // The database names and types too: two table objects of one name may differ in them.
  const columns = Object.entries(info.columns).map(([key, c]) => `${key}=${c.name}:${c.getSQLType()}`);
  return `${info.label}|${columns.join(',')}|${method}|${same}|${entries.map(([k]) => k).join(',')}`;
}

function keyCondition(info: TableInfo, key: Entries, values: Record<string, unknown>): SQL {
  return sql.join(
    key.map(([name, value], i) => {
      const column = info.columns[name] as PgColumn;
      return sql`${column} = ${bind(values, `k${i}`, value, column)}`;
    }),
    sql` and `,
  );
}

function sets(info: TableInfo, patch: Entries, values: Record<string, unknown>): SQL[] {
  return patch.map(([name, value], i) => {
    const column = info.columns[name] as PgColumn;
    return sql`${bare(column)} = ${bind(values, `v${i}`, value, column)}`;
  });
}

/** Reads the row before the write and joins the write's RETURNING onto it: always exactly one result row. */
function withPrevious(info: TableInfo, where: SQL, write: SQL): SQL {
  const t = info.table;
  return sql`with prev as (select ${t.lastFence} as fence, ${t.deletedAt} is not null as deleted from ${t} where ${where}),
w as (${write})
select w.*, (select fence from prev) as ${sql.identifier(PREV_FENCE)}, (select deleted from prev) as ${sql.identifier(PREV_DELETED)}
from (select 1) as palisade_one left join w on true`;
}

const returning = sql.raw(`returning *, true as ${APPLIED}`);

/**
 * `UPDATE … SET patch, last_fence = $fence WHERE key AND live AND last_fence < $fence`.
 * A tombstone is not live: the update writes nothing there (no fence moves),
 * exactly as for a row that does not exist.
 */
export function updateStatement(
  info: TableInfo,
  key: Entries,
  patch: Entries,
  fence: bigint,
  same: SameFence,
): Statement {
  const values: Record<string, unknown> = { fence };
  const t = info.table;
  const build = () => {
    const where = keyCondition(info, key, values);
    const assignments = [...sets(info, patch, values), sql`${bare(t.lastFence)} = ${fenceParam(info)}`];
    return withPrevious(
      info,
      where,
      sql`update ${t} set ${sql.join(assignments, sql`, `)}
  where ${where} and ${t.deletedAt} is null and ${t.lastFence} ${cmp(same)} ${fenceParam(info)} ${returning}`,
    );
  };
  const statement = { key: shape('update', info, same, patch), build, values };
  fillValues(statement, key, patch);
  return statement;
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
 * invisible to the snapshot, so a row the statement newly inserted (`xmax =
 * 0`) is checked again against the floor with a fresh snapshot
 * (`palisade.check_tombstone_floor`, SQLSTATE 40001 when it refuses).
 */
export function upsertStatement(
  info: TableInfo,
  key: Entries,
  row: Entries,
  fence: bigint,
  same: SameFence,
): Statement {
  const values: Record<string, unknown> = { fence, floorTable: info.label };
  const t = info.table;
  const build = () => {
    const where = keyCondition(info, key, values);
    const columns = row.map(([name]) => info.columns[name] as PgColumn);
    const inserted = row.map(([name, value], i) => bind(values, `v${i}`, value, info.columns[name] as PgColumn));
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
    const table = new Param(sql.placeholder('floorTable'));
    const allowEqual = sql.raw(same === 'allow' ? 'true' : 'false');
    return sql`with prev as (select ${t.lastFence} as fence, ${t.deletedAt} is not null as deleted from ${t} where ${where}),
floor as (select coalesce((select f.floor from palisade.tombstone_floors f where f.table_name = ${table}), 0) as fence),
w as (insert into ${t} (${sql.join([...columns.map(bare), bare(t.lastFence), bare(t.deletedAt)], sql`, `)})
  select ${sql.join([...inserted, fenceParam(info), sql`null`], sql`, `)}
  where exists (select 1 from prev) or (select fence from floor) ${cmp(same)} ${fenceParam(info)}
  on conflict (${sql.join(keyColumns, sql`, `)}) do update set ${sql.join(updates, sql`, `)}
  where ${t.lastFence} ${cmp(same)} excluded.${bare(t.lastFence)}
  returning *, true as ${sql.identifier(APPLIED)},
    case when xmax = 0 then palisade.check_tombstone_floor(${table}, ${fenceParam(info)}, ${allowEqual}) end as palisade_floor_checked)
select w.*, (select fence from prev) as ${sql.identifier(PREV_FENCE)}, (select deleted from prev) as ${sql.identifier(PREV_DELETED)},
  (select fence from floor) as ${sql.identifier(FLOOR)}
from (select 1) as palisade_one left join w on true`;
  };
  const statement = { key: shape('upsert', info, same, row), build, values };
  fillValues(statement, key, row);
  return statement;
}

/** Marks a live row deleted: a tombstone that keeps the fence. A tombstone is not live: nothing is written. */
export function deleteStatement(info: TableInfo, key: Entries, fence: bigint, same: SameFence): Statement {
  const values: Record<string, unknown> = { fence };
  const t = info.table;
  const build = () => {
    const where = keyCondition(info, key, values);
    return withPrevious(
      info,
      where,
      sql`update ${t} set ${bare(t.deletedAt)} = now(), ${bare(t.lastFence)} = ${fenceParam(info)}
  where ${where} and ${t.deletedAt} is null and ${t.lastFence} ${cmp(same)} ${fenceParam(info)} ${returning}`,
    );
  };
  const statement = { key: shape('delete', info, same, []), build, values };
  fillValues(statement, key, []);
  return statement;
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
  const assignments = [...sets(info, patch, values), sql`${bare(t.lastFence)} = ${fenceParam(info)}`];
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
function fillValues(statement: Statement, key: Entries, patch: Entries): void {
  key.forEach(([, value], i) => {
    statement.values[`k${i}`] = value;
  });
  patch.forEach(([, value], i) => {
    if (!isSql(value)) statement.values[`v${i}`] = value;
  });
}
