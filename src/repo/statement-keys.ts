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

// Schema objects live as long as the process: a number each is a cheap, exact stand-in for how they compile.
const ids = new WeakMap<object, number>();
let lastId = 0;
/** @internal A number that stands for `object` (a column, a table, an encoder) in statement cache keys. */
export function idOf(object: object): number {
  let id = ids.get(object);
  if (id === undefined) {
    id = ++lastId;
    ids.set(object, id);
  }
  return id;
}

// How a column encodes a value for the driver, which cached statements keep with each placeholder: its
// class, a custom type's own `toDriver` (custom columns share one class), and an array's element encoder
// (every array shares one class, and `text[]` of a custom type has the SQL type `text[]`).
function encoderOf(column: TableInfo['columnList'][number]): string {
  const custom = (column as { mapTo?: unknown }).mapTo;
  const element = (column as { baseColumn?: TableInfo['columnList'][number] }).baseColumn;
  return `${idOf(column.constructor)}${typeof custom === 'function' ? `.${idOf(custom)}` : ''}${
    typeof element === 'object' && element !== null ? `[${encoderOf(element)}]` : ''
  }`;
}

/**
 * Everything of a table definition that a compiled statement depends on:
 * schema and name (apart: `"s.acc"` and `s.acc` share a label), the
 * primary key in its order, and every column's key, database name, type,
 * encoder and whether it is generated. Two table objects of one table may differ in any
 * of them; worked out once per table object.
 */
export function tableShape(info: TableInfo): string {
  let shape = tableShapes.get(info);
  if (shape === undefined) {
    // JSON: keys and names may hold any character (a key "x,y" beside keys x and y).
    const columns = Object.entries(info.columns).map(([key, c]) => [
      key,
      c.name,
      c.getSQLType(),
      encoderOf(c),
      Boolean(c.generated || c.generatedIdentity),
    ]);
    shape = JSON.stringify([info.schema ?? null, info.name, info.keyNames, columns]);
    tableShapes.set(info, shape);
  }
  return shape;
}

type Keys = { readonly write: string; readonly refusal: string };
/** How a write's statement claims a lock register (see `Claim` in statements.ts): part of its text. */
export type ClaimMode = 'none' | 'claim' | 'shared';

// By table, then by the write's variant (a small number), then by the patch's shape: no key is
// concatenated, and hashed afresh, on the hot path.
const keysByTable = new WeakMap<TableInfo, Map<number, Map<string, Keys>>>();
const CLAIM_MODES: readonly ClaimMode[] = ['none', 'claim', 'shared'];

/**
 * The cache keys of an update's or delete's two statements (the write, the
 * refusal), built once per shape.
 */
export function cacheKeys(
  info: TableInfo,
  method: 'update' | 'delete',
  same: SameFence,
  shapeKey: string,
  returning: Returning,
  claim: ClaimMode,
): Keys {
  let byVariant = keysByTable.get(info);
  if (byVariant === undefined) {
    byVariant = new Map();
    keysByTable.set(info, byVariant);
  }
  const variant =
    (method === 'delete' ? 12 : 0) +
    (same === 'allow' ? 6 : 0) +
    (returning === 'row' ? 3 : 0) +
    CLAIM_MODES.indexOf(claim);
  let byShape = byVariant.get(variant);
  if (byShape === undefined) {
    byShape = new Map();
    byVariant.set(variant, byShape);
  }
  let keys = byShape.get(shapeKey);
  if (keys === undefined) {
    const base = `${tableShape(info)}|${method}|${same}|${shapeKey}`;
    keys = { write: `${base}|${returning}${claim === 'none' ? '' : `|${claim}`}`, refusal: `${base}|refusal` };
    byShape.set(shapeKey, keys);
  }
  return keys;
}

/** The key of a one-statement write (an upsert), `undefined` when an SQL value makes its text one-off. */
export function shape(method: string, info: TableInfo, same: SameFence, entries: Entries): string | undefined {
  if (entries.some(([, v]) => isSql(v))) return undefined;
  return `${tableShape(info)}|${method}|${same}|${JSON.stringify(entries.map(([k]) => k))}`;
}
