/**
 * SQL expressions in a patch (`{ balance: sql\`${t.balance} + ${amount}\` }`)
 * turned into statement templates: every value the expression carries
 * becomes a named placeholder, so a statement's text depends only on the
 * expression's structure and is compiled once and reused (and prepared on
 * the server) like a statement with plain values.
 */
import { Column, is, Name, Param, SQL, StringChunk, sql as sqlTag, Table } from 'drizzle-orm';

/** An expression with its values lifted into placeholders. */
export interface ExpressionTemplate {
  readonly sql: SQL;
  /**
   * Equal shapes compile to equal text (on one database object): the text
   * chunks, identifiers and placeholders in order, columns and tables by
   * identity. Built without compiling, which would cost more than the rest
   * of the call.
   */
  readonly shape: string;
}

// Schema objects live as long as the process: a number each is a cheap, exact stand-in for how they compile.
const ids = new WeakMap<object, number>();
let lastId = 0;
const idOf = (object: object): number => {
  let id = ids.get(object);
  if (id === undefined) {
    id = ++lastId;
    ids.set(object, id);
  }
  return id;
};

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
  let n = 0;
  let shape = '';
  const lift = (value: unknown, encoder?: Param['encoder']): Param => {
    const name = `${prefix}_${n++}`;
    values[name] = value;
    shape += '\u0000$';
    // A null is sent as is: drizzle never passes it to an encoder when it compiles the value in place.
    return new Param(sqlTag.placeholder(name), value === null ? undefined : encoder);
  };
  const rewrite = (chunks: readonly unknown[]): unknown[] | undefined => {
    const out: unknown[] = [];
    for (const chunk of chunks) {
      if (chunk === undefined) {
        out.push(chunk);
      } else if (is(chunk, StringChunk)) {
        shape += `\u0000s${chunk.value.join('')}`;
        out.push(chunk);
      } else if (is(chunk, Name)) {
        shape += `\u0000n${chunk.value}`;
        out.push(chunk);
      } else if (is(chunk, Column) || is(chunk, Table)) {
        shape += `\u0000o${idOf(chunk)}`;
        out.push(chunk);
      } else if (is(chunk, SQL)) {
        if (inlines(chunk)) return undefined;
        shape += '\u0000(';
        const inner = rewrite(chunk.queryChunks);
        if (!inner) return undefined;
        shape += '\u0000)';
        out.push(new SQL(inner as SQL['queryChunks']));
      } else if (is(chunk, Param)) {
        if (!isPlainValue(chunk.value)) return undefined;
        out.push(lift(chunk.value, chunk.encoder));
      } else if (isPlainValue(chunk)) {
        out.push(lift(chunk));
      } else {
        return undefined;
      }
    }
    return out;
  };
  const chunks = inlines(expression) ? undefined : rewrite(expression.queryChunks);
  if (!chunks) return undefined;
  return { sql: new SQL(chunks as SQL['queryChunks']), shape };
}

// `.inlineParams()` writes the values into the text: not a template.
const inlines = (expression: SQL) => (expression as unknown as { shouldInlineParams: boolean }).shouldInlineParams;

/** Values a driver takes as one parameter whatever they are: their SQL text is `$n`. */
function isPlainValue(value: unknown): boolean {
  if (value === null) return true;
  const type = typeof value;
  if (type === 'string' || type === 'number' || type === 'boolean' || type === 'bigint') return true;
  return value instanceof Date;
}
