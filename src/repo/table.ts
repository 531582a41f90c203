/**
 * What a repository needs to know about a fenced table, worked out once:
 * its primary-key columns, how to turn a driver row into a drizzle row, and
 * what a valid key or patch looks like. The generic "any table" types stop
 * here (drizzle issues #4207, #4367): everything above sees `FencedTable`.
 */
import { and, eq, getTableColumns, is, SQL, sql } from 'drizzle-orm';
import { getTableConfig, type PgColumn, type PgTable } from 'drizzle-orm/pg-core';
import type { RawRow } from '../driver.js';
import { InvalidArgumentError } from '../errors.js';
import { FENCE_COLUMN_NAMES } from '../schema/fence-columns.js';

/** A drizzle `pgTable` that spreads `fenceColumns()`. */
export type FencedTable = PgTable & { lastFence: PgColumn; deletedAt: PgColumn };

/** A row as drizzle selects it. */
export type RowOf<T extends FencedTable> = T['$inferSelect'];

/** A primary key: the key columns (by their TypeScript names) and their values. */
export type KeyOf<T extends FencedTable> = Partial<T['$inferSelect']>;

type Writable<T extends FencedTable> = Omit<T['$inferInsert'], 'lastFence' | 'deletedAt'>;

/** Columns to change, each a value or an SQL expression (`sql\`${t.n} + 1\``). The fence columns are palisade's. */
export type PatchOf<T extends FencedTable> = { [K in keyof Writable<T>]?: Writable<T>[K] | SQL };

/** Values for an upsert: a full insert row (fence columns excluded), values or SQL. */
export type ValuesOf<T extends FencedTable> = { [K in keyof Writable<T>]: Writable<T>[K] | SQL };

/**
 * True for a drizzle SQL expression. drizzle's `is()` throws on objects
 * without a prototype (`Object.create(null)`, a jsonb value built that way),
 * which are plain values here.
 */
export function isSql(value: unknown): value is SQL {
  return typeof value === 'object' && value !== null && Object.getPrototypeOf(value) !== null && is(value, SQL);
}

/** The table facts a repository uses on every call. */
export interface TableInfo {
  readonly table: FencedTable;
  /** `schema.name` or `name`, for messages. */
  readonly label: string;
  /**
   * The table as a `regclass` literal (`'"schema"."name"'::regclass`, or `'"name"'::regclass` for the
   * search path's), the key of its tombstone floor. A literal, not a parameter: Postgres resolves it
   * when it plans the statement, as it resolves the table the statement writes — a prepared plan
   * keeps both, even after a table of that name appears earlier on the search path.
   */
  readonly regclass: SQL;
  /** The table's schema, `undefined` for the search path's. */
  readonly schema: string | undefined;
  /** The table's name in its schema. */
  readonly name: string;
  /** TypeScript key → column, every column. */
  readonly columns: Readonly<Record<string, PgColumn>>;
  /** TypeScript keys of the primary key, in declaration order. */
  readonly keyNames: readonly string[];
  /** Every column's TypeScript key, in declaration order: a row returned by a write is mapped by these two. */
  readonly columnKeys: readonly string[];
  /** Every column, in the order of {@link columnKeys}. */
  readonly columnList: readonly PgColumn[];
}

// By TypeScript key and by database name: neither spelling may be patched.
const FENCE_KEYS = new Set<string>(['lastFence', 'deletedAt', ...FENCE_COLUMN_NAMES]);

// drizzle's own mark of an alias() (a registered symbol, not exported in its types).
const IS_ALIAS = Symbol.for('drizzle:IsAlias');

/**
 * Inspects `table` and checks it is fenced and has a primary key.
 * @throws {InvalidArgumentError} when it is not a fenced table with a primary key.
 */
export function describeTable(table: FencedTable): TableInfo {
  const config = getTableConfig(table);
  const label = config.schema ? `${config.schema}.${config.name}` : config.name;
  // An alias compiles to its alias name (without the schema) but describes the table it aliases: its
  // writes would land in whatever table bears the alias name, and share the table's statements.
  if ((table as unknown as Record<symbol, unknown>)[IS_ALIAS] === true) {
    throw new InvalidArgumentError(`table ${label} is given as an alias(): give the table itself`);
  }
  const columns = getTableColumns(table) as Record<string, PgColumn>;
  if (columns.lastFence?.name !== 'last_fence' || columns.deletedAt?.name !== 'deleted_at') {
    throw new InvalidArgumentError(`table ${label} is not fenced: spread fenceColumns() into it`);
  }
  // By database name: `primaryKey({ columns })` holds copies made for the extra config, not these columns.
  const byName = new Map(Object.entries(columns).map(([key, col]) => [col.name, key]));
  const composite = config.primaryKeys[0]?.columns;
  const keyColumns = composite ?? Object.values(columns).filter((c) => c.primary);
  if (keyColumns.length === 0) throw new InvalidArgumentError(`table ${label} has no primary key`);
  const keyNames = keyColumns.map((c) => {
    const name = byName.get(c.name);
    if (!name) throw new InvalidArgumentError(`table ${label}: primary-key column ${c.name} not found`);
    return name;
  });
  const quoted = (name: string) => `"${name.replaceAll('"', '""')}"`;
  const qualified = config.schema ? `${quoted(config.schema)}.${quoted(config.name)}` : quoted(config.name);
  return {
    table,
    label,
    regclass: sql.raw(`'${qualified.replaceAll("'", "''")}'::regclass`),
    schema: config.schema,
    name: config.name,
    columns,
    keyNames,
    columnKeys: Object.keys(columns),
    columnList: Object.values(columns),
  };
}

/** A primary key as checked entries (TypeScript column key, value), in key order. */
export type KeyEntries = readonly (readonly [string, unknown])[];

/**
 * Checks that `key` names exactly the primary-key columns, each with a
 * non-null plain value, and returns its entries in key order.
 */
export function keyEntries(info: TableInfo, key: unknown): [string, unknown][] {
  if (key === null || typeof key !== 'object' || Array.isArray(key)) {
    throw new InvalidArgumentError(`key for ${info.label} must be an object of its primary-key columns`);
  }
  for (const name in key) {
    if (Object.hasOwn(key, name) && !info.keyNames.includes(name)) {
      const extra = Object.keys(key).filter((k) => !info.keyNames.includes(k));
      throw new InvalidArgumentError(`key for ${info.label} has non-key columns: ${extra.join(', ')}`);
    }
  }
  return info.keyNames.map((name) => {
    const value = (key as Record<string, unknown>)[name];
    if (value === undefined || value === null) {
      throw new InvalidArgumentError(`key for ${info.label} is missing ${name}`);
    }
    // Key values are placeholders in cached statements: an SQL expression would be frozen into the text.
    if (isSql(value)) throw new InvalidArgumentError(`key for ${info.label}: ${name} must be a value, not SQL`);
    return [name, value];
  });
}

/**
 * Checks a patch (or upsert values) and returns its entries, undefined values
 * dropped. The fence columns are refused always; key columns unless
 * `allowKey` (an upsert must name its key).
 */
export function patchEntries(info: TableInfo, patch: unknown, allowKey: boolean): [string, unknown][] {
  // A Map or Set has no own keys: read as an object it would be an empty patch that only moves the fence.
  if (
    patch === null ||
    typeof patch !== 'object' ||
    Array.isArray(patch) ||
    patch instanceof Map ||
    patch instanceof Set
  ) {
    throw new InvalidArgumentError(`patch for ${info.label} must be an object of column values`);
  }
  // A plain object literal is never SQL; anything else is asked (drizzle's is() walks its prototypes).
  if (Object.getPrototypeOf(patch) !== Object.prototype && isSql(patch)) {
    throw new InvalidArgumentError(`patch for ${info.label} must be an object of column values`);
  }
  const entries: [string, unknown][] = [];
  // Own enumerable string keys, as Object.entries gives them, without its array of pairs.
  for (const name in patch) {
    if (!Object.hasOwn(patch, name)) continue;
    const value = (patch as Record<string, unknown>)[name];
    if (FENCE_KEYS.has(name)) {
      throw new InvalidArgumentError(`patch for ${info.label} may not set ${name}: palisade writes the fence columns`);
    }
    // Own properties only: `toString` or `__proto__` are not columns.
    if (!Object.hasOwn(info.columns, name)) throw new InvalidArgumentError(`${info.label} has no column ${name}`);
    if (!allowKey && info.keyNames.includes(name)) {
      throw new InvalidArgumentError(`patch for ${info.label} may not change key column ${name}`);
    }
    if (value !== undefined) entries.push([name, value]);
  }
  return entries;
}

/** Turns a driver row (database column names, raw values) into a drizzle row. */
export function mapRow(info: TableInfo, raw: RawRow): Record<string, unknown> {
  const row: Record<string, unknown> = {};
  const { columnKeys, columnList } = info;
  for (let i = 0; i < columnList.length; i++) {
    const column = columnList[i] as PgColumn;
    const value = raw[column.name];
    row[columnKeys[i] as string] = value === null || value === undefined ? null : column.mapFromDriverValue(value);
  }
  return row;
}

/** `key` (entries from {@link keyEntries}) as a condition with inline parameters, for reads off the hot path. */
export function keyWhere(info: TableInfo, key: KeyEntries): SQL {
  return and(...key.map(([name, value]) => eq(info.columns[name] as PgColumn, value))) as SQL;
}
/**
 * @internal The table's tombstone floor, as a scalar subquery (null while it has none). Its `=` is named:
 * `regclass` has none of its own in the catalog, and under the connection's search path another role's
 * `=(regclass, regclass)` would match better and hide the floor.
 */
export const floorSql = (info: TableInfo): SQL =>
  sql`(select f.floor from palisade.tombstone_floors f where f.fenced_table operator(pg_catalog.=) palisade.floor_table(${info.regclass}))`;
