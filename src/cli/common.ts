/**
 * What every `palisade` subcommand shares: argument parsing with one-line
 * usage errors, output streams, and connecting to `DATABASE_URL`.
 */
import { parseArgs } from 'node:util';
import type postgres from 'postgres';
import { CliError, MissingDependencyError } from '../errors.js';
import { loadPeer, type OptionalPeer } from '../optional.js';

/** Where a command writes: data on `out`, progress and diagnostics on `err`. */
export interface Io {
  out(text: string): void;
  err(text: string): void;
  readonly env: NodeJS.ProcessEnv;
}

/** One subcommand: its summary for `palisade --help`, its full help, and what it does. */
export interface Command {
  readonly summary: string;
  readonly help: string;
  run(argv: string[], io: Io): Promise<number>;
}

type OptionSpec = NonNullable<NonNullable<Parameters<typeof parseArgs>[0]>['options']>;

/** What {@link parse} found: option values by long name (`help` always known), and positionals. */
export interface ParsedArgs {
  readonly values: { readonly help?: boolean } & Readonly<Record<string, string | boolean | undefined>>;
  readonly positionals: string[];
}

/**
 * `parseArgs` in strict mode, with `--help` / `-h` added; an unknown or
 * malformed option becomes a {@link CliError} (exit code 2) naming the
 * command's `--help`.
 */
export function parse(command: string, argv: string[], options: OptionSpec, allowPositionals = false): ParsedArgs {
  try {
    const { values, positionals } = parseArgs({
      args: argv,
      options: { ...options, help: { type: 'boolean', short: 'h' } },
      allowPositionals,
      strict: true,
    });
    return { values: values as ParsedArgs['values'], positionals };
  } catch (err) {
    const message = err instanceof Error ? err.message.split('\n')[0] : String(err);
    throw new CliError(`${message} (see: palisade ${command} --help)`, 2);
  }
}

/** The value of `DATABASE_URL`, or a {@link CliError} saying what to set. */
export function requireDatabaseUrl(io: Io, why: string): string {
  const url = io.env.DATABASE_URL;
  if (!url) {
    throw new CliError(`DATABASE_URL is not set: ${why} (e.g. DATABASE_URL=postgres://user@127.0.0.1:5432/app)`);
  }
  try {
    new URL(url);
  } catch {
    throw new CliError('DATABASE_URL is not a valid URL (expected postgres://user@host:port/database)');
  }
  return url;
}

/** `host:port/database` of a Postgres URL: never the user or password. */
export function describeUrl(url: string): string {
  try {
    const u = new URL(url);
    return `${u.hostname}${u.port ? `:${u.port}` : ''}${u.pathname}`;
  } catch {
    return '(unparsable URL)';
  }
}

/**
 * A postgres.js client for one CLI run: one connection, bounded connect
 * time, notices silenced. postgres.js is an optional peer dependency of the
 * library, but the CLI needs it: a missing one is a one-line error saying
 * what to install.
 */
export async function connect(url: string): Promise<postgres.Sql> {
  const { default: postgres } = await loadCliPeer<{ default: typeof import('postgres') }>('postgres');
  return postgres(url, {
    max: 1,
    connect_timeout: 10,
    fetch_types: false, // a connection killed at connect would otherwise end the process (README)
    onnotice: () => {},
    connection: { application_name: 'palisade-cli' },
  });
}

/**
 * Turns a connection failure into a one-line {@link CliError} that names
 * the server (never the credentials); other errors pass through.
 */
export function connectionError(err: unknown, url: string): unknown {
  for (let e: unknown = err, depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === 'string' && CONNECTION_CODES.has(code)) {
      const reason = e instanceof Error ? e.message : String(e);
      return new CliError(`cannot connect to ${describeUrl(url)}: ${reason}`);
    }
  }
  return err;
}

// Network failures (Node, postgres.js) and the server refusing the login or the database.
const CONNECTION_CODES = new Set([
  'ECONNREFUSED',
  'ENOTFOUND',
  'EHOSTUNREACH',
  'ECONNRESET',
  'ENOENT',
  'CONNECT_TIMEOUT',
  'CONNECTION_CLOSED',
  'CONNECTION_ENDED',
  'CONNECTION_DESTROYED',
  '28P01',
  '28000',
  '3D000',
]);

/** `1.2s`, `3m04s`, `2h05m`: a duration for people. */
export function formatDuration(ms: number): string {
  if (!Number.isFinite(ms)) return '-';
  const negative = ms < 0;
  const abs = Math.abs(ms);
  let text: string;
  if (abs < 1000) text = `${Math.round(abs)}ms`;
  else if (abs < 60_000) text = `${(abs / 1000).toFixed(1)}s`;
  else if (abs < 3_600_000) {
    const s = Math.floor(abs / 1000);
    text = `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s`;
  } else {
    const m = Math.floor(abs / 60_000);
    text = `${Math.floor(m / 60)}h${String(m % 60).padStart(2, '0')}m`;
  }
  return negative ? `-${text}` : text;
}

/** Left-aligned columns, two spaces apart. */
export function table(header: readonly string[], rows: readonly (readonly string[])[]): string {
  const shown = rows.map((r) => r.map(printable));
  const widths = header.map((h, i) => Math.max(h.length, ...shown.map((r) => columns(r[i] ?? ''))));
  const line = (cells: readonly string[]) =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c + ' '.repeat(Math.max(0, (widths[i] ?? 0) - columns(c)))))
      .join('  ')
      .trimEnd();
  return [line(header), ...shown.map(line)].join('\n');
}

// A cell as one line: names and holders are anyone's text, and a line break or a terminal control in one
// would forge rows of the table. Escaped as in JSON (\n, \u001b), the backslash too.
// biome-ignore lint/suspicious/noControlCharactersInRegex: finding control characters is the point.
const CONTROL = /[\\\u0000-\u001f\u007f-\u009f\u2028\u2029]/g;
const ESCAPES: Readonly<Record<string, string>> = { '\\': '\\\\', '\n': '\\n', '\r': '\\r', '\t': '\\t' };
const printable = (cell: string) =>
  cell.replace(CONTROL, (c) => ESCAPES[c] ?? `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
// Columns a cell takes on a terminal, roughly: a code point each, combining marks none.
const columns = (cell: string) => [...cell.replace(/\p{M}/gu, '')].length;

/** JSON with bigints as decimal strings (fences exceed 2^53). */
export function toJson(value: unknown): string {
  return JSON.stringify(value, (_key, v) => (typeof v === 'bigint' ? v.toString() : v), 2);
}

/**
 * Checks that every optional peer a command will load is installed, before it starts: a one-line
 * {@link CliError} names every missing package, and its npx form names all the command needs (the one
 * missing alone would drop those already given).
 */
export async function requireCliPeers(names: readonly OptionalPeer[]): Promise<void> {
  const settled = await Promise.allSettled(names.map((name) => loadPeer(name, 'this palisade command')));
  const missing = new Set<string>();
  for (const r of settled) {
    if (r.status === 'rejected' && r.reason instanceof MissingDependencyError) missing.add(r.reason.packageName);
    else if (r.status === 'rejected') throw r.reason;
  }
  if (missing.size === 0) return;
  const all = [...new Set(names.map((n) => (n.startsWith('drizzle-orm/') ? 'drizzle-orm' : n)))];
  const list = [...missing];
  throw new CliError(
    `needs the package${list.length > 1 ? 's' : ''} ${list.map((m) => `"${m}"`).join(', ')}, not installed: ` +
      `npm i ${list.join(' ')} (or run the CLI with npx -p palisade-db ${all.map((n) => `-p ${n}`).join(' ')} palisade …)`,
  );
}

/** Loads an optional peer for a command, or a one-line {@link CliError} naming the package to install. */
export async function loadCliPeer<T>(name: Parameters<typeof loadPeer>[0]): Promise<T> {
  try {
    return await loadPeer<T>(name, 'this palisade command');
  } catch (err) {
    if (err instanceof MissingDependencyError) {
      throw new CliError(
        `needs the package "${err.packageName}", which is not installed: npm i ${err.packageName} ` +
          `(or run the CLI with npx -p palisade-db -p ${err.packageName} palisade …)`,
      );
    }
    throw err;
  }
}
