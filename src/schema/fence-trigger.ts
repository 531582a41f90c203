/**
 * The fence trigger: a database-side guard for fenced tables that other
 * writers (psql, a report job, another service) also touch. What it refuses
 * and what every palisade write still does: README, "Adding fencing to an
 * existing table".
 */
import { is } from 'drizzle-orm';
import { getTableConfig, PgTable } from 'drizzle-orm/pg-core';
import { InvalidArgumentError } from '../errors.js';

/**
 * The SQLSTATE of a write refused by the fence trigger: class `PF`
 * ("palisade fence"), outside every class Postgres itself uses.
 */
export const FENCE_TRIGGER_SQLSTATE = 'PF001';

/** Name of the trigger function and of the triggers it runs as. */
export const FENCE_TRIGGER_NAME = 'palisade_fence_guard';
/** Name of the function that raises the tombstone floor after a delete, and of its trigger. */
const FLOOR_TRIGGER_NAME = 'palisade_fence_floor';
/**
 * Name of the trigger that refuses a change of a row's primary key: `~` sorts it after the table's own
 * `BEFORE UPDATE` triggers named from letters, digits and `_` (triggers of one kind fire in byte order of their
 * names), so it sees the key as they left it — before Postgres moves a row whose key left its partition, which
 * no AFTER UPDATE trigger sees.
 */
const KEY_TRIGGER_NAME = `~${FENCE_TRIGGER_NAME}_key`;
/** The key trigger's name before it ran last: dropped by a new install. */
const OLD_KEY_TRIGGER_NAME = `${FENCE_TRIGGER_NAME}_key`;
/** @internal Name of the trigger that checks the row once every BEFORE trigger of the table had its say. */
export const AFTER_TRIGGER_NAME = `${FENCE_TRIGGER_NAME}_after`;

/** Options of {@link fenceTriggerSql} and {@link installFenceTrigger}. */
export interface FenceTriggerOptions {
  /**
   * `'reject'` (default): an update must set `last_fence` strictly above the
   * row's. `'allow'`: equal is accepted too — for tables written by a
   * repository with `sameFence: 'allow'`; a plain `UPDATE` that leaves
   * `last_fence` alone then also passes, only lowering it is refused.
   */
  readonly sameFence?: 'reject' | 'allow';
  /** Refuse a `DELETE` of a row that is not a tombstone (default `true`). */
  readonly guardDeletes?: boolean;
}

/** A table to guard: a drizzle `pgTable` with `fenceColumns()`, or its name (and schema). */
export type FenceTriggerTarget = PgTable | { readonly name: string; readonly schema?: string };

const STATEMENT_BREAKPOINT = '\n--> statement-breakpoint\n';

/**
 * The SQL that installs the fence trigger on `table`, as the text of a
 * drizzle-kit custom migration (statements separated by
 * `--> statement-breakpoint`). Paste it into the file that
 * `drizzle-kit generate --custom` creates, after the migration that added
 * `fenceColumns()` to the table.
 *
 * Idempotent: it replaces the function and drops the triggers before
 * creating them. The function is created in the table's schema (or, for a
 * table without a schema, the first schema of the `search_path`).
 *
 * Guarantees: once installed, no `UPDATE` — from any client, role or
 * service — leaves `last_fence` where it was or lowers it, or changes a
 * row's primary key, and (by default) no `DELETE` removes a live row; such
 * statements fail with SQLSTATE {@link FENCE_TRIGGER_SQLSTATE} and change
 * nothing. A `DELETE` of tombstones raises the table's tombstone floor in
 * its own statement, through any name of the table (README, "The fence
 * trigger"), so the deleting role needs to write `palisade.tombstone_floors`
 * (or the delete fails, and removes nothing). Run it in one transaction: it
 * drops the triggers before it creates them.
 *
 * Does not: check that a raised fence was ever issued by a lock manager (a
 * writer that invents `last_fence = last_fence + 1` passes, and may then
 * fence out honest holders); guard `INSERT` (a new row starts at fence 0,
 * which any holder may overwrite) or `TRUNCATE`; fire when triggers are
 * disabled (`ALTER TABLE … DISABLE TRIGGER`, `session_replication_role =
 * replica`) — which is also the escape hatch for a deliberate manual fix;
 * hold against a session that sets palisade's transaction-local settings
 * (`palisade.floor_open_…`, `palisade.purging`, `palisade.purge_floors`) itself.
 *
 * @throws {InvalidArgumentError} if `table` is a drizzle table without `fenceColumns()`, or a name is empty
 *   or contains a control character (newline, NUL…), a line separator or a lone surrogate.
 */
export function fenceTriggerSql(table: FenceTriggerTarget, options: FenceTriggerOptions = {}): string {
  return fenceTriggerStatements(table, options).join(STATEMENT_BREAKPOINT);
}

/**
 * The statements of {@link fenceTriggerSql}, one string each, for callers
 * that run them themselves.
 */
export function fenceTriggerStatements(table: FenceTriggerTarget, options: FenceTriggerOptions = {}): string[] {
  const { schema, name } = target(table);
  const sameFence = options.sameFence ?? 'reject';
  if (sameFence !== 'reject' && sameFence !== 'allow') {
    throw new InvalidArgumentError("sameFence must be 'reject' or 'allow'");
  }
  const guardDeletes = options.guardDeletes ?? true;
  const qualified = schema === undefined ? ident(name) : `${ident(schema)}.${ident(name)}`;
  const fn = schema === undefined ? ident(FENCE_TRIGGER_NAME) : `${ident(schema)}.${ident(FENCE_TRIGGER_NAME)}`;
  const floorFn = schema === undefined ? ident(FLOOR_TRIGGER_NAME) : `${ident(schema)}.${ident(FLOOR_TRIGGER_NAME)}`;
  const deleteTrigger = ident(`${FENCE_TRIGGER_NAME}_delete`);
  const statements = [
    `CREATE OR REPLACE FUNCTION ${fn}() RETURNS trigger LANGUAGE plpgsql AS $palisade$
DECLARE
  floor_key text;
  pending bigint;
  listed text;
  purging boolean;
BEGIN
  IF TG_OP = 'UPDATE' THEN
    IF TG_ARGV[0] = 'after' THEN
      RAISE EXCEPTION USING
        ERRCODE = '${FENCE_TRIGGER_SQLSTATE}',
        MESSAGE = format('update of %I.%I refused once the table''s own triggers ran: the row''s primary key changed, or its last_fence did not rise',
                         TG_TABLE_SCHEMA, TG_TABLE_NAME),
        HINT = 'a BEFORE UPDATE trigger of the table must leave the key and last_fence as palisade wrote them';
    END IF;
    IF TG_ARGV[0] = 'key' THEN
      RAISE EXCEPTION USING
        ERRCODE = '${FENCE_TRIGGER_SQLSTATE}',
        MESSAGE = format('update of the primary key of a row of %I.%I refused: its old key would be left without its fence',
                         TG_TABLE_SCHEMA, TG_TABLE_NAME),
        HINT = 'a fenced row keeps its key: delete it fenced, and write the new key with a fence';
    END IF;
    IF NEW.last_fence IS NULL OR NEW.last_fence < OLD.last_fence
       OR (NEW.last_fence = OLD.last_fence AND TG_ARGV[0] IS DISTINCT FROM 'allow') THEN
      RAISE EXCEPTION USING
        ERRCODE = '${FENCE_TRIGGER_SQLSTATE}',
        MESSAGE = format('unfenced update of %I.%I refused: last_fence must rise above %s (the statement set %s)',
                         TG_TABLE_SCHEMA, TG_TABLE_NAME, OLD.last_fence, coalesce(NEW.last_fence::text, 'null')),
        HINT = 'write through a palisade fenced repository with a fence from a lock manager';
    END IF;
    RETURN NEW;
  END IF;
  IF OLD.deleted_at IS NULL THEN
    RAISE EXCEPTION USING
      ERRCODE = '${FENCE_TRIGGER_SQLSTATE}',
      MESSAGE = format('delete of a live row of %I.%I refused: delete it fenced (a tombstone); only tombstones may be purged',
                       TG_TABLE_SCHEMA, TG_TABLE_NAME),
      HINT = 'use a palisade fenced repository: delete(key, fence), then purgeTombstones()';
  END IF;
  -- A tombstone goes. While a DELETE of a table that shares this row's floor is open (its statement
  -- triggers count it), or a palisade purge's statement runs (marked until its end; rows at the first
  -- trigger depth: the purge's own, or removed by code it runs, a row security policy's function), the
  -- fence is left pending to the first of their ends that raises the floor (a purge's end raises the floors
  -- it lists). Otherwise — a partition made after the install, a DELETE through an inheritance parent —
  -- this row raises it now (a command of its own: a raise at a later end sees it). Not taken at the first
  -- row of a purge: two purges of overlapping batches would each hold the floor's row lock and wait for the
  -- other's rows.
  floor_key := palisade.floor_table(TG_RELID::regclass)::oid::text;
  purging := current_setting('palisade.purging', true) IS NOT DISTINCT FROM statement_timestamp()::text
             AND pg_trigger_depth() = 1;
  IF purging OR coalesce(nullif(current_setting('palisade.floor_open_' || floor_key, true), '')::int, 0) > 0 THEN
    IF purging THEN
      listed := coalesce(current_setting('palisade.purge_floors', true), '');
      IF position(' ' || floor_key || ' ' IN ' ' || listed || ' ') = 0 THEN
        PERFORM set_config('palisade.purge_floors', concat_ws(' ', nullif(listed, ''), floor_key), true);
      END IF;
    END IF;
    -- Written only when it rises (a purge's rows rarely do).
    pending := nullif(current_setting('palisade.floor_pending_' || floor_key, true), '')::bigint;
    IF pending IS NULL OR OLD.last_fence > pending THEN
      PERFORM set_config('palisade.floor_pending_' || floor_key, OLD.last_fence::text, true);
    END IF;
  ELSE
    PERFORM palisade.raise_floor(palisade.floor_table(TG_RELID::regclass), OLD.last_fence);
  END IF;
  RETURN OLD;
END
$palisade$`,
    // The statement triggers of a DELETE. Before it, the open DELETEs of its table's floor count one more
    // (transaction-local): the row trigger above then leaves the floor to their ends, noting the fences of rows
    // deleted meanwhile by statements nested in one (a function its WHERE calls) as pending. After it, the
    // floor rises to the highest fence removed, once (a purge raises the same floor in its own statement:
    // raised twice, the greater wins), at the end, where the purge raises it: a row trigger raising it would
    // take the floor's row lock at the first row, and two purges of overlapping batches would each wait for
    // the other. Open DELETEs are counted per floor, not stacked: the statement triggers of one query's
    // DELETEs of several tables (data-modifying CTEs) end in no fixed order. The floor each one opened is
    // stacked per table, which fires its statement triggers once per query: a DELETE of one table nested in
    // another's (a function its WHERE calls) begins and ends inside it, and may find another floor (a
    // partition attached meanwhile) — kept in one setting per table, the nested one's overwrote the outer's,
    // whose end closed the wrong floor and left its own count open to the end of the transaction.
    `CREATE OR REPLACE FUNCTION ${floorFn}() RETURNS trigger LANGUAGE plpgsql AS $palisade$
DECLARE
  floor_key text;
  opened text := 'palisade.floor_of_' || TG_RELID;
  stack text := nullif(current_setting(opened, true), '');
  open int;
  pending bigint;
  top bigint;
BEGIN
  IF TG_WHEN = 'BEFORE' THEN
    floor_key := palisade.floor_table(TG_RELID::regclass)::oid::text;
    PERFORM set_config(opened, concat_ws(' ', stack, floor_key), true);
    open := coalesce(nullif(current_setting('palisade.floor_open_' || floor_key, true), '')::int, 0);
    PERFORM set_config('palisade.floor_open_' || floor_key, (open + 1)::text, true);
    RETURN NULL;
  END IF;
  -- The floor the statement began with: a partition detached or attached while it ran has another now.
  floor_key := coalesce(substring(stack from '[0-9]+$'), palisade.floor_table(TG_RELID::regclass)::oid::text);
  PERFORM set_config(opened, coalesce(substring(stack from '^(.*) [0-9]+$'), ''), true);
  open := coalesce(nullif(current_setting('palisade.floor_open_' || floor_key, true), '')::int, 0);
  pending := nullif(current_setting('palisade.floor_pending_' || floor_key, true), '')::bigint;
  top := greatest((SELECT max(gone.last_fence) FROM palisade_gone gone), pending);
  IF top IS NOT NULL THEN
    PERFORM palisade.raise_floor(floor_key::oid::regclass, top);
  END IF;
  PERFORM set_config('palisade.floor_pending_' || floor_key, '', true);
  PERFORM set_config('palisade.floor_open_' || floor_key, greatest(open - 1, 0)::text, true);
  RETURN NULL;
END
$palisade$`,
    ...dropFenceTriggerStatements({ name, ...(schema === undefined ? {} : { schema }) }),
    `CREATE TRIGGER ${ident(`${FENCE_TRIGGER_NAME}_update`)} BEFORE UPDATE ON ${qualified} FOR EACH ROW EXECUTE FUNCTION ${fn}('${sameFence}')`,
    // The key's columns, fired only when one changed (Postgres evaluates WHEN itself; whatever set it: the
    // statement, or a trigger of the table before this one). A table without a primary key gets none: a fenced
    // repository needs one. Then the row as every BEFORE trigger left it — the table's own may run after the
    // guards and change last_fence, or the key after the key trigger (a name that sorts after it) — checked
    // after the update: the key (a generated one too, which a BEFORE trigger's WHEN may not read) and
    // last_fence. Not instead of the checks before it: a row the update moves to another partition is deleted
    // and inserted there, and fires no AFTER UPDATE trigger.
    doBlock(
      'changed text; every_changed text;',
      `SELECT string_agg(format('OLD.%1$I IS DISTINCT FROM NEW.%1$I', a.attname), ' OR ' ORDER BY k.n)
           FILTER (WHERE a.attgenerated = '' AND NOT EXISTS (
             -- Generated in a partition (Postgres 15 attaches one): NEW holds no value there yet.
             SELECT FROM pg_partition_tree(${literal(qualified)}::regclass) tree
               JOIN pg_catalog.pg_attribute m ON m.attrelid = tree.relid AND m.attname = a.attname
              WHERE m.attgenerated <> '')),
         string_agg(format('OLD.%1$I IS DISTINCT FROM NEW.%1$I', a.attname), ' OR ' ORDER BY k.n)
    INTO changed, every_changed
    FROM pg_catalog.pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
    JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
    -- The key's own columns: an index's INCLUDE columns follow them in indkey.
    WHERE i.indrelid = ${literal(qualified)}::regclass AND i.indisprimary AND k.n <= i.indnkeyatts;
  IF changed IS NOT NULL THEN
    EXECUTE format('CREATE TRIGGER %I BEFORE UPDATE ON %s FOR EACH ROW WHEN (%s) EXECUTE FUNCTION %s(%L)',
                   ${literal(KEY_TRIGGER_NAME)}, ${literal(qualified)}, changed, ${literal(fn)}, 'key');
  END IF;
  EXECUTE format('CREATE TRIGGER %I AFTER UPDATE ON %s FOR EACH ROW WHEN (%s) EXECUTE FUNCTION %s(%L)',
                 ${literal(AFTER_TRIGGER_NAME)}, ${literal(qualified)},
                 concat_ws(' OR ', every_changed, ${literal(`NEW.last_fence IS NULL OR NEW.last_fence ${sameFence === 'allow' ? '<' : '<='} OLD.last_fence`)}),
                 ${literal(fn)}, 'after');`,
    ),
  ];
  if (guardDeletes) {
    statements.push(
      `CREATE TRIGGER ${deleteTrigger} BEFORE DELETE ON ${qualified} FOR EACH ROW EXECUTE FUNCTION ${fn}()`,
      onEveryMember(
        qualified,
        `EXECUTE format('CREATE TRIGGER %I BEFORE DELETE ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s()', ${literal(`${FLOOR_TRIGGER_NAME}_before`)}, member, ${literal(floorFn)});
    EXECUTE format('CREATE TRIGGER %I AFTER DELETE ON %s REFERENCING OLD TABLE AS palisade_gone FOR EACH STATEMENT EXECUTE FUNCTION %s()', ${literal(FLOOR_TRIGGER_NAME)}, member, ${literal(floorFn)});`,
      ),
    );
  }
  return statements;
}

/**
 * The statements that remove the trigger from `table` (the functions stay:
 * other tables of the schema may use them).
 */
export function dropFenceTriggerStatements(table: FenceTriggerTarget): string[] {
  const { schema, name } = target(table);
  const qualified = schema === undefined ? ident(name) : `${ident(schema)}.${ident(name)}`;
  return [
    `DROP TRIGGER IF EXISTS ${ident(`${FENCE_TRIGGER_NAME}_update`)} ON ${qualified}`,
    `DROP TRIGGER IF EXISTS ${ident(`${FENCE_TRIGGER_NAME}_delete`)} ON ${qualified}`,
    `DROP TRIGGER IF EXISTS ${ident(KEY_TRIGGER_NAME)} ON ${qualified}`,
    `DROP TRIGGER IF EXISTS ${ident(OLD_KEY_TRIGGER_NAME)} ON ${qualified}`,
    `DROP TRIGGER IF EXISTS ${ident(AFTER_TRIGGER_NAME)} ON ${qualified}`,
    onEveryMember(
      qualified,
      `EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s', ${literal(FLOOR_TRIGGER_NAME)}, member);
    EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s', ${literal(`${FLOOR_TRIGGER_NAME}_before`)}, member);`,
    ),
  ];
}

/**
 * A `DO` block that runs `action` (PL/pgSQL, with `member` bound) for the
 * table and each table of its partition tree as it stands now. The floor
 * triggers go on every one of them: a statement trigger fires only on the
 * table a statement names, and Postgres clones only row triggers to
 * partitions — with them on the parent alone, every tombstone a `DELETE`
 * through a partition's own name removed would raise the floor row by row.
 * Foreign tables are skipped (they take no transition tables).
 */
function onEveryMember(qualified: string, action: string): string {
  const table = `${literal(qualified)}::regclass`;
  return doBlock(
    'member regclass;',
    `FOR member IN
    SELECT tree.t FROM (SELECT ${table} AS t UNION SELECT relid FROM pg_partition_tree(${table})) tree
    JOIN pg_catalog.pg_class c ON c.oid = tree.t WHERE c.relkind IN ('r', 'p')
  LOOP
    ${action}
  END LOOP;`,
  );
}

/** A `DO` block: PL/pgSQL `body` (which holds the table's name), with the variables of `declare`. */
function doBlock(declare: string, body: string): string {
  const text = `
DECLARE ${declare}
BEGIN
  ${body}
END
`;
  // A dollar-quote tag that the text does not contain.
  let tag = '$palisade$';
  for (let i = 1; text.includes(tag); i++) tag = `$palisade${i}$`;
  return `DO ${tag}${text}${tag}`;
}

/** `text` as an SQL string literal. */
function literal(text: string): string {
  return `'${text.replaceAll("'", "''")}'`;
}

/** Anything with drizzle's `execute` (a database or a transaction of any Postgres driver). */
interface Executor {
  execute(query: string): PromiseLike<unknown>;
}

/**
 * Installs the fence trigger on `table` now (see {@link fenceTriggerSql}
 * for what it guarantees and what it does not), each statement in turn on
 * `db` — pass a transaction to make it all-or-nothing. Prefer a migration in
 * production, so every environment gets it the same way.
 *
 * @throws {InvalidArgumentError} as {@link fenceTriggerSql}; the driver's error if the table does not exist
 *   or lacks `last_fence` / `deleted_at`.
 */
export async function installFenceTrigger(
  db: Executor,
  table: FenceTriggerTarget,
  options: FenceTriggerOptions = {},
): Promise<void> {
  for (const statement of fenceTriggerStatements(table, options)) await db.execute(statement);
}

function target(table: FenceTriggerTarget): { schema: string | undefined; name: string } {
  if (is(table, PgTable)) {
    const config = getTableConfig(table);
    const names = new Set(config.columns.map((c) => c.name));
    if (!names.has('last_fence') || !names.has('deleted_at')) {
      throw new InvalidArgumentError(`table ${config.name} is not fenced: spread fenceColumns() into it`);
    }
    return { schema: config.schema, name: config.name };
  }
  const t = table as { name?: unknown; schema?: unknown } | null;
  if (!t || typeof t.name !== 'string' || t.name.length === 0) {
    throw new InvalidArgumentError('fence trigger target must be a drizzle table or { name, schema? }');
  }
  if (t.schema !== undefined && (typeof t.schema !== 'string' || t.schema.length === 0)) {
    throw new InvalidArgumentError('fence trigger schema must be a non-empty string');
  }
  return { schema: t.schema as string | undefined, name: t.name };
}

// C0 controls (newline, carriage return, tab, NUL…), DEL, C1 controls (NEL…), and the
// Unicode line and paragraph separators.
const CONTROL = /[\p{Cc}\p{Zl}\p{Zp}]/u;

/**
 * A double-quoted SQL identifier. Quoting makes any character safe *inside
 * the SQL*, but the name is also printed into `--` comment lines (the CLI's
 * header), which a newline would end, turning the rest of the name into a
 * bare SQL line; editors show U+2028/U+2029 as line breaks too. No real
 * table needs such a name, so control characters are refused outright (the
 * message does not repeat the name: it is exactly what must not be printed).
 */
function ident(name: string): string {
  if (!name.isWellFormed() || CONTROL.test(name)) {
    throw new InvalidArgumentError(
      'table and schema names must not contain control characters, line separators or lone surrogates',
    );
  }
  // drizzle's migrator splits a migration file at this text wherever it stands, even inside a quoted name.
  if (name.includes('--> statement-breakpoint')) {
    throw new InvalidArgumentError("table and schema names must not contain drizzle's '--> statement-breakpoint'");
  }
  return `"${name.replaceAll('"', '""')}"`;
}
