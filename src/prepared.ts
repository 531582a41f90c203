/**
 * Statements compiled once per database session and reused (the write
 * path's, the claims', the Postgres lock backends'), and what makes reusing
 * one cheap: a short server-side name, each placeholder sent once, and on
 * postgres.js no wrapper between the statement and the client. Everything
 * else a driver does differently stays in driver.ts.
 */
import { createHash } from 'node:crypto';
import { entityKind, is, Param, Placeholder, type SQL } from 'drizzle-orm';
import type { PgDialect, PgPreparedQuery, PgSession } from 'drizzle-orm/pg-core';
import { affectedOf, type Database, internals, type RawRow, rowsOf, translateError } from './driver.js';
import { DriverError } from './errors.js';
import { assertMaySend } from './overlap.js';

/**
 * The server-side name of a prepared statement: short (Postgres truncates
 * names to 63 bytes, so long names collide) and a function of the statement
 * itself, so two different statements never share a name and one statement
 * always gets the same one, on every connection of a pool.
 */
export function statementName(key: string, text: string): string {
  return `palisade_${createHash('sha256').update(key).update('\0').update(text).digest('hex').slice(0, 32)}`;
}

/**
 * A statement compiled once per session: run it for its result rows, or
 * for how many rows it wrote (a statement without RETURNING).
 */
export interface Prepared {
  rows(values: Record<string, unknown>): Promise<RawRow[]>;
  count(values: Record<string, unknown>): Promise<number>;
}

const preparedBySession = new WeakMap<object, Map<string, Prepared>>();

interface Compiled {
  readonly sql: string;
  readonly params: unknown[];
  readonly name: string;
}
// What a key compiles to, per dialect (one per drizzle database, shared by its transactions): a
// transaction is a session of its own, and compiling its statements again on each one cost every
// fenced transaction, modify and claim tens of µs (the builder, the numbering, the name's hash).
const compiledByDialect = new WeakMap<PgDialect, Map<string, Compiled>>();

function compiledOf(dialect: PgDialect, key: string, build: () => SQL): Compiled {
  let byKey = compiledByDialect.get(dialect);
  if (!byKey) {
    byKey = new Map();
    compiledByDialect.set(dialect, byKey);
  }
  let compiled = byKey.get(key);
  if (!compiled) {
    const { sql, params } = compileOnce(dialect, build());
    compiled = { sql, params, name: statementName(key, sql) };
    byKey.set(key, compiled);
  }
  return compiled;
}

/**
 * A statement that is compiled once per database and `key` (its
 * transactions share the text; each session keeps its own prepared query):
 * `build()` runs only on the first call, later calls only fill the
 * placeholders. Use
 * `sql.placeholder(name)` (or `new Param(placeholder, column)` to keep a
 * column's encoder) inside the built SQL. With no `key` the statement is
 * compiled for this call only.
 */
export function prepared(db: Database, key: string | undefined, build: () => SQL): Prepared {
  assertMaySend(db);
  const { session, dialect } = internals(db);
  let cache = preparedBySession.get(session);
  if (!cache) {
    cache = new Map();
    preparedBySession.set(session, cache);
  }
  if (key === undefined) return compile(session, compileOnce(dialect, build()), undefined);
  let statement = cache.get(key);
  if (!statement) {
    // A name makes drizzle's drivers send a named (server-side prepared) statement; without one
    // postgres.js parses and describes it in an extra round trip on every call. node-postgres
    // sends the name to the server as is: a hash keeps it short and unique.
    const compiled = compiledOf(dialect, key, build);
    statement = compile(session, compiled, compiled.name);
    cache.set(key, statement);
  }
  return statement;
}

/**
 * `dialect.sqlToQuery(query)`, except that a placeholder used several times
 * (a write's fence appears in its SET, its WHERE and its lock claim) is
 * sent once and referred to by the same `$n`: every parameter costs the
 * client a serialisation and the server a conversion, on every call.
 */
function compileOnce(dialect: PgDialect, query: SQL): { sql: string; params: unknown[] } {
  // Keyed by name and encoder: the same name encoded two ways is two parameters.
  const sent: { name: string; encoder: unknown }[] = [];
  const fresh: boolean[] = [];
  const escapeParam = (_num: number, value: unknown): string => {
    const param = is(value, Param) && is(value.value, Placeholder) ? value : undefined;
    const placeholder = param ? (param.value as Placeholder) : value;
    if (is(placeholder, Placeholder)) {
      const encoder = param?.encoder;
      const known = sent.findIndex((s) => s.name === placeholder.name && s.encoder === encoder);
      fresh.push(known < 0);
      if (known >= 0) return `$${known + 1}`;
      sent.push({ name: placeholder.name, encoder });
    } else {
      fresh.push(true);
      sent.push({ name: '', encoder: Symbol('a value of its own: never shared') });
    }
    return `$${sent.length}`;
  };
  // The database's own dialect (its casing, its drizzle version), with only escapeParam replaced.
  const numbering = Object.create(dialect, { escapeParam: { value: escapeParam } }) as PgDialect;
  const compiled = numbering.sqlToQuery(query);
  return { sql: compiled.sql, params: compiled.params.filter((_, i) => fresh[i]) };
}

type Run = (values: Record<string, unknown>) => Promise<unknown>;

function compile(session: PgSession, compiled: { sql: string; params: unknown[] }, name: string | undefined): Prepared {
  const run = directRun(session, compiled, name) ?? drizzleRun(session, compiled, name);
  // One `then` per call, not an async frame (its promise and the await's): on every write.
  const sent = <R>(values: Record<string, unknown>, read: (result: unknown) => R): Promise<R> => {
    try {
      return run(values).then(read, translated);
    } catch (err) {
      return Promise.reject(translateError(err));
    }
  };
  return {
    rows: (values) => sent(values, rowsOf),
    count: (values) => sent(values, affectedOf),
  };
}

const translated = (err: unknown): never => {
  throw translateError(err);
};

function drizzleRun(session: PgSession, compiled: { sql: string; params: unknown[] }, name: string | undefined): Run {
  const query = session.prepareQuery(compiled as never, undefined, name, false) as PgPreparedQuery<never>;
  return (values) => query.execute(values);
}

const PREPARE = { prepare: true } as const;

/**
 * postgres.js, called directly rather than through drizzle's prepared
 * query (its tracing, cache and logging layers cost a few µs per write):
 * the same client, the same text, the same parameters. Only while the
 * database has no drizzle logger, so a user's query log stays complete.
 */
function directRun(
  session: PgSession,
  compiled: { sql: string; params: unknown[] },
  name: string | undefined,
): Run | undefined {
  const kind = (session.constructor as { [entityKind]?: unknown })[entityKind];
  const { client, logger } = session as unknown as { client?: unknown; logger?: { constructor?: unknown } };
  const quiet = (logger?.constructor as { [entityKind]?: unknown } | undefined)?.[entityKind] === 'NoopLogger';
  if (kind !== 'PostgresJsSession' || !quiet || name === undefined) return undefined;
  const unsafe = (client as { unsafe?: unknown }).unsafe;
  if (typeof unsafe !== 'function') return undefined;
  const text = compiled.sql;
  const fill = filler(compiled.params);
  return (values) => unsafe.call(client, text, fill(values), PREPARE);
}

/**
 * drizzle's `fillPlaceholders`, with the parameter list inspected once
 * rather than on every call.
 */
function filler(params: readonly unknown[]): (values: Record<string, unknown>) => unknown[] {
  const slots = params.map((p) => {
    if (is(p, Placeholder)) return { name: p.name, encode: undefined, value: undefined };
    if (is(p, Param) && is(p.value, Placeholder)) {
      const { encoder } = p;
      return { name: p.value.name, encode: (v: unknown) => encoder.mapToDriverValue(v), value: undefined };
    }
    return { name: undefined, encode: undefined, value: p };
  });
  return (values) => {
    const out = new Array<unknown>(slots.length);
    for (let i = 0; i < slots.length; i++) {
      const { name, encode, value } = slots[i] as (typeof slots)[number];
      if (name === undefined) out[i] = value;
      else if (!(name in values)) throw new DriverError(`no value for placeholder ${name}`);
      else out[i] = encode ? encode(values[name]) : values[name];
    }
    return out;
  };
}
