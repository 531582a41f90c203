/**
 * SQL expressions in a patch (`{ balance: sql\`${t.balance} + ${amount}\` }`)
 * turned into statement templates: every value the expression carries
 * becomes a named placeholder, so a statement's text depends only on the
 * expression's structure and is compiled once and reused (and prepared on
 * the server) like a statement with plain values.
 */
import { Column, entityKind, is, type Name, Param, SQL, type StringChunk, sql as sqlTag, Table } from 'drizzle-orm';
import { idOf } from './statement-keys.js';

/** An expression with its values lifted into placeholders. */
export interface ExpressionTemplate {
  /**
   * The expression with placeholders in place of its values. Built only
   * when the statement is compiled — once per shape, not per call.
   */
  readonly sql: () => SQL;
  /**
   * Equal shapes compile to equal text (on one database object) and encode
   * their values alike: the text chunks, identifiers and placeholders in
   * order, columns, tables and each placeholder's encoder by identity. Built without compiling, which would cost more than the rest
   * of the call.
   */
  readonly shape: string;
}

/**
 * Lifts the values of `expression` into placeholders named `${prefix}_${i}`
 * (recorded in `values`). `undefined` when the expression holds something
 * whose text is not a function of its structure alone (a placeholder of the
 * caller's, a subquery, a view, an array, an object value, inlined
 * parameters): such a statement is compiled for its call only, as before.
 */
export function templateOf(
  expression: SQL,
  prefix: string,
  values: Record<string, unknown>,
): ExpressionTemplate | undefined {
  let shape = '';
  let n = 0;
  // One walk for the shape and the values; `build` walks again only when the statement is compiled.
  const walk = (chunks: readonly unknown[], build: boolean): unknown[] | undefined | false => {
    const out: unknown[] | undefined = build ? [] : undefined;
    for (const chunk of chunks) {
      const kind = kindOf(chunk);
      if (chunk === undefined) {
        out?.push(chunk);
      } else if (kind === 'StringChunk') {
        if (!build) shape += `\u0000s${(chunk as StringChunk).value.join('')}`;
        out?.push(chunk);
      } else if (kind === 'Name') {
        if (!build) shape += `\u0000n${(chunk as Name).value}`;
        out?.push(chunk);
      } else if (kind === 'SQL') {
        if (inlines(chunk as SQL)) return false;
        if (!build) shape += '\u0000(';
        const inner = walk((chunk as SQL).queryChunks, build);
        if (inner === false) return false;
        if (!build) shape += '\u0000)';
        out?.push(new SQL(inner as SQL['queryChunks']));
      } else if (kind === 'Param' || isPlainValue(chunk)) {
        const value = kind === 'Param' ? (chunk as Param).value : chunk;
        if (!isPlainValue(value)) return false;
        const name = `${prefix}_${n++}`;
        if (build) {
          // A null is sent as is: drizzle never passes it to an encoder when it compiles the value in place.
          const encoder = value === null || kind !== 'Param' ? undefined : (chunk as Param).encoder;
          out?.push(new Param(sqlTag.placeholder(name), encoder));
        } else {
          values[name] = value;
          // The encoder too (a null is sent without one): a value that one call encodes as JSON and
          // another sends as it is must not share a compiled statement.
          shape +=
            kind !== 'Param' ? '\u0000$' : value === null ? '\u0000$null' : `\u0000$${idOf((chunk as Param).encoder)}`;
        }
      } else if (is(chunk, Column) || is(chunk, Table)) {
        if (!build) shape += `\u0000o${idOf(chunk as object)}`;
        out?.push(chunk);
      } else {
        return false;
      }
    }
    return out;
  };
  if (inlines(expression) || walk(expression.queryChunks, false) === false) return undefined;
  return {
    shape,
    sql: () => {
      n = 0;
      return new SQL(walk(expression.queryChunks, true) as SQL['queryChunks']);
    },
  };
}

// drizzle's `is()` walks the prototype chain on every test; the classes a template meets most
// (text, names, nested SQL, parameters) are never subclassed, so their own kind decides at once.
const kindOf = (chunk: unknown): unknown =>
  typeof chunk === 'object' && chunk !== null
    ? (chunk.constructor as { [entityKind]?: unknown } | undefined)?.[entityKind]
    : undefined;

// `.inlineParams()` writes the values into the text: not a template.
const inlines = (expression: SQL) => (expression as unknown as { shouldInlineParams: boolean }).shouldInlineParams;

/** Values a driver takes as one parameter whatever they are: their SQL text is `$n`. */
function isPlainValue(value: unknown): boolean {
  if (value === null) return true;
  const type = typeof value;
  if (type === 'string' || type === 'number' || type === 'boolean' || type === 'bigint') return true;
  return value instanceof Date;
}
