/**
 * What palisade may repeat of a database server's error: the SQLSTATE, its
 * condition name and the objects the server names, never a value (see
 * `DatabaseError` and the README's "Errors" section).
 */

/** The SQLSTATE of a driver error, whichever driver and however wrapped. */
export function sqlStateOf(err: unknown): string | undefined {
  for (let e: unknown = err, depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const known = (e as { sqlState?: unknown }).sqlState;
    if (typeof known === 'string' && /^[0-9A-Z]{5}$/.test(known)) return known;
    const code = (e as { code?: unknown }).code;
    if (typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code)) return code;
  }
  return undefined;
}

/**
 * SQLSTATE classes whose server messages name objects of the schema or the
 * server (never a value a statement carried): connection (08), feature not
 * supported (0A), transaction state (25, 2D), authorization (28), catalog
 * and schema names (3D, 3F), rollback (40), syntax and access rules (42:
 * identifiers and tokens of the query text — palisade sends every value as a
 * parameter), resources (53), object state and locks (55), operator
 * intervention (57), system errors (58), and palisade's fence trigger (PF:
 * table name and fences). Data exceptions (22), integrity violations (23,
 * whose DETAIL quotes the row), PL/pgSQL RAISE (P0) and internal errors (XX)
 * are described by their fields only.
 */
const SERVER_TEXT_CLASSES = new Set([
  '08',
  '0A',
  '25',
  '2D',
  '28',
  '3D',
  '3F',
  '40',
  '42',
  '53',
  '55',
  '57',
  '58',
  'PF',
]);

/** Condition names of the SQLSTATEs a palisade user meets most (the rest show the code alone). */
const CONDITIONS: Record<string, string> = {
  '22001': 'string_data_right_truncation',
  '22003': 'numeric_value_out_of_range',
  '22007': 'invalid_datetime_format',
  '22008': 'datetime_field_overflow',
  '22012': 'division_by_zero',
  '22021': 'character_not_in_repertoire',
  '22023': 'invalid_parameter_value',
  '22P02': 'invalid_text_representation',
  '22P05': 'untranslatable_character',
  '23502': 'not_null_violation',
  '23503': 'foreign_key_violation',
  '23505': 'unique_violation',
  '23514': 'check_violation',
  '23P01': 'exclusion_violation',
  '25P02': 'in_failed_sql_transaction',
  '40001': 'serialization_failure',
  '40P01': 'deadlock_detected',
  '42501': 'insufficient_privilege',
  '42601': 'syntax_error',
  '42703': 'undefined_column',
  '42804': 'datatype_mismatch',
  '42883': 'undefined_function',
  '42P01': 'undefined_table',
  '55P03': 'lock_not_available',
  '57014': 'query_canceled',
  '57P01': 'admin_shutdown',
  P0001: 'raise_exception',
};

/** Error codes (not SQLSTATEs) of a connection that failed: their messages name the server, not data. */
const CONNECTION_CODES = /^(E[A-Z]+|CONNECT_TIMEOUT|CONNECTION_[A-Z]+)$/;
// node-postgres's errors for a connection that ended carry no code: told by their fixed texts, which name
// no data. Kept in the message, with the code postgres.js gives the same failure.
const PG_CONNECTION_ENDED =
  /^(Connection terminated( unexpectedly)?|Client has encountered a connection error and is not queryable|Client was closed and is not queryable)$/;
/**
 * Whether `state` is a SQLSTATE of a session the server ends, or may have: the idle timeout (25P03), a
 * terminated backend (57P01–57P03), a link that failed (class 08).
 */
export const endingState = (state: string | undefined): boolean =>
  state !== undefined && /^(25P03|08...|57P0[1-3])$/.test(state);

/**
 * Whether a postgres.js statement failed because its connection closed: postgres.js's own code for that or a
 * socket's (no severity: not from the server), or the server's FATAL, with which it ends the session — not a
 * SQLSTATE of class 08 or 57 raised as a plain ERROR on a live session (a remote link's, say).
 */
export function closedBy(err: unknown): boolean {
  const { code, severity } = (err ?? {}) as { code?: unknown; severity?: unknown };
  if (severity === 'FATAL' || severity === 'PANIC') return true;
  return severity === undefined && typeof code === 'string' && /^(CONNECTION_[A-Z]+|E[A-Z]+)$/.test(code);
}

/**
 * Whether `err` (a driver's error, palisade's `DatabaseError` of one, either under a wrapper) says its
 * session or connection ended — not that a statement failed.
 */
export function sessionEnded(err: unknown): boolean {
  // The codes of a closed connection first: EPIPE has a SQLSTATE's shape.
  for (let e: unknown = originalError(err), depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const { code, message } = e as { code?: unknown; message?: unknown };
    if (typeof code === 'string' && /^(CONNECTION_[A-Z]+|ECONNRESET|EPIPE)$/.test(code)) return true;
    if (code === undefined && typeof message === 'string' && PG_CONNECTION_ENDED.test(message)) return true;
  }
  return endingState(sqlStateOf(err));
}

export interface SafeFields {
  schema?: string;
  table?: string;
  column?: string;
  dataType?: string;
  constraint?: string;
}

/** Reads one of the server's error fields as postgres.js (`table_name`) or pg-protocol (`table`: PGlite, pg) names it. */
function field(err: object, ...names: string[]): string | undefined {
  for (const name of names) {
    const value = (err as Record<string, unknown>)[name];
    if (typeof value === 'string' && value.length > 0) return value;
  }
  return undefined;
}

/**
 * The message, sanitised cause and fields of a driver error: the facts of
 * {@link SafeFields} and the server's text only where it cannot quote a value.
 */
export function describeServerError(
  cause: unknown,
  sqlState: string | undefined,
): { message: string; error: Error; fields: SafeFields } {
  // Already described (a DatabaseError made again from its own cause, with outcomeUnknown): as it is.
  if (cause instanceof Error && described.has(cause)) {
    const fields: SafeFields = {};
    for (const name of ['schema', 'table', 'column', 'dataType', 'constraint'] as const) {
      const value = field(cause, name);
      if (value) fields[name] = value;
    }
    return { message: cause.message, error: cause, fields };
  }
  const original = originalError(cause);
  const err = original !== null && typeof original === 'object' ? original : {};
  const fields: SafeFields = {};
  const schema = field(err, 'schema_name', 'schema');
  const table = field(err, 'table_name', 'table');
  const column = field(err, 'column_name', 'column');
  const dataType = field(err, 'data_type', 'dataType');
  const constraint = field(err, 'constraint_name', 'constraint');
  if (schema) fields.schema = schema;
  if (table) fields.table = table;
  if (column) fields.column = column;
  if (dataType) fields.dataType = dataType;
  if (constraint) fields.constraint = constraint;

  const parts: string[] = [];
  if (sqlState) {
    const condition = CONDITIONS[sqlState];
    parts.push(`SQLSTATE ${sqlState}${condition ? ` ${condition}` : ''}`);
  }
  const on = [
    table ? `table ${schema ? `${schema}.` : ''}${table}` : undefined,
    column ? `column ${column}` : undefined,
    dataType ? `type ${dataType}` : undefined,
    constraint ? `constraint ${constraint}` : undefined,
  ].filter((x) => x !== undefined);
  if (on.length > 0) parts.push(on.join(', '));
  const text = original instanceof Error ? original.message : undefined;
  const pgEnded = !sqlState && text !== undefined && PG_CONNECTION_ENDED.test(text);
  const code = pgEnded ? 'CONNECTION_ENDED' : (err as { code?: unknown }).code;
  if (text && sqlState && SERVER_TEXT_CLASSES.has(sqlState.slice(0, 2))) parts.push(text);
  else if (text && !sqlState && typeof code === 'string' && CONNECTION_CODES.test(code)) parts.push(text);
  else if (!sqlState) parts.push(`${original instanceof Error ? original.name : typeof original} from the driver`);
  const message = `database error: ${parts.join('; ')}`;

  // The cause: the same facts, as an error of the driver's class name, without its message, detail or parameters.
  const error = new Error(message);
  error.name = original instanceof Error ? original.name : 'Error';
  Object.assign(error, { ...(sqlState ? { code: sqlState } : typeof code === 'string' ? { code } : {}), ...fields });
  const severity = field(err, 'severity');
  if (severity) Object.assign(error, { severity });
  described.add(error);
  return { message, error, fields };
}

// The causes describeServerError made: safe already.
const described = new WeakSet<Error>();

/** The driver's own error under drizzle's `DrizzleQueryError` wrapper (which lists the parameters). */
export function originalError(err: unknown): unknown {
  const cause = (err as { cause?: unknown } | null)?.cause;
  return (err as { name?: unknown } | null)?.constructor?.name === 'DrizzleQueryError' && cause ? cause : err;
}
