/**
 * What names a statement's text, for the caches of compiled statements
 * (../prepared.ts): the table's shape, the write method, the fence
 * comparison and the shape of the patch — never a value, which is always a
 * placeholder.
 */
import type { Returning, SameFence } from './statements.js';
import { isSql, type TableInfo } from './table.js';

type Entries = readonly (readonly [string, unknown])[];

const tableShapes = new WeakMap<TableInfo, string>();

/** The table's name with every column's key, database name and type (two table objects of one name may differ in them); worked out once per table. */
export function tableShape(info: TableInfo): string {
  let shape = tableShapes.get(info);
  if (shape === undefined) {
    const columns = Object.entries(info.columns).map(([key, c]) => `${key}=${c.name}:${c.getSQLType()}`);
    shape = `${info.label}|${columns.join(',')}`;
    tableShapes.set(info, shape);
  }
  return shape;
}

const keysByTable = new WeakMap<TableInfo, Map<string, { write: string; refusal: string }>>();

/**
 * The cache keys of an update's or delete's two statements (the write, the
 * refusal), built once per shape: a key built afresh is a long string to
 * concatenate and hash on every call, on the hot path.
 */
export function cacheKeys(
  info: TableInfo,
  method: string,
  same: SameFence,
  shapeKey: string,
  returning: Returning,
  claim: 'none' | 'claim' | 'shared',
) {
  let byShape = keysByTable.get(info);
  if (byShape === undefined) {
    byShape = new Map();
    keysByTable.set(info, byShape);
  }
  const short = `${method}|${same}|${returning}|${claim}|${shapeKey}`;
  let keys = byShape.get(short);
  if (keys === undefined) {
    const base = `${tableShape(info)}|${method}|${same}|${shapeKey}`;
    keys = { write: `${base}|${returning}${claim === 'none' ? '' : `|${claim}`}`, refusal: `${base}|refusal` };
    byShape.set(short, keys);
  }
  return keys;
}

/** The key of a one-statement write (an upsert), `undefined` when an SQL value makes its text one-off. */
export function shape(method: string, info: TableInfo, same: SameFence, entries: Entries): string | undefined {
  if (entries.some(([, v]) => isSql(v))) return undefined;
  return `${tableShape(info)}|${method}|${same}|${entries.map(([k]) => k).join(',')}`;
}
