/**
 * A database-side guard for fenced tables that other writers also touch.
 *
 * palisade's repository only ever writes with a fence, but psql, a report
 * job or another service can still run a plain `UPDATE`. The trigger
 * installed here makes Postgres refuse, for one table:
 *
 * - any `UPDATE` that does not raise `last_fence` (with `sameFence:
 *   'allow'`: that lowers it), so a writer that bypasses palisade is fenced
 *   out too;
 * - unless `guardDeletes: false`, any `DELETE` of a live row: palisade
 *   deletes by leaving a tombstone (`deleted_at`), and only tombstones may be
 *   removed for good (`purgeTombstones`); and a `DELETE` of tombstones from
 *   any client raises the table's tombstone floor to their highest fence, as
 *   a purge does, so that no lower fence can recreate a row it removed.
 *
 * Everything palisade's repository does passes: every fenced update, delete,
 * tombstone fence raise and upsert sets `last_fence` to a fence above the
 * row's, and purging removes tombstones only.
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
 * service — leaves `last_fence` where it was or lowers it, and (by default)
 * no `DELETE` removes a live row; such statements fail with SQLSTATE
 * {@link FENCE_TRIGGER_SQLSTATE} and change nothing. A `DELETE` of
 * tombstones raises the table's tombstone floor in its own statement, so
 * the deleting role needs to write `palisade.tombstone_floors` (or the
 * delete fails, and removes nothing) — through the partitioned table or
 * any of its partitions; a partition that joined the tree after the install
 * refuses deletes of its tombstones until the install runs again (README,
 * "The fence trigger").
 *
 * Does not: check that a raised fence was ever issued by a lock manager (a
 * writer that invents `last_fence = last_fence + 1` passes, and may then
 * fence out honest holders); guard `INSERT` (a new row starts at fence 0,
 * which any holder may overwrite) or `TRUNCATE`; fire when triggers are
 * disabled (`ALTER TABLE … DISABLE TRIGGER`, `session_replication_role =
 * replica`) — which is also the escape hatch for a deliberate manual fix.
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
  const updateTrigger = ident(`${FENCE_TRIGGER_NAME}_update`);
  const deleteTrigger = ident(`${FENCE_TRIGGER_NAME}_delete`);
  const statements = [
    `CREATE OR REPLACE FUNCTION ${fn}() RETURNS trigger LANGUAGE plpgsql AS $palisade$
BEGIN
  IF TG_OP = 'UPDATE' THEN
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
  -- A partition that joined the tree after the install has the row triggers (cloned) but no floor trigger.
  -- Checked once per partition and transaction (a purge deletes thousands of rows).
  IF pg_partition_root(TG_RELID) IS NOT NULL
     AND current_setting('palisade.floor_checked_' || TG_RELID::oid, true) IS DISTINCT FROM 'yes'
     AND set_config('palisade.floor_checked_' || TG_RELID::oid, 'yes', true) = 'yes' AND EXISTS (
    SELECT 1 FROM pg_partition_ancestors(TG_RELID) a WHERE NOT EXISTS (
      SELECT 1 FROM pg_catalog.pg_trigger t WHERE t.tgrelid = a.relid AND t.tgname = '${FLOOR_TRIGGER_NAME}')) THEN
    RAISE EXCEPTION USING
      ERRCODE = '${FENCE_TRIGGER_SQLSTATE}',
      MESSAGE = format('delete of tombstones from %I.%I refused: a table of its partition tree joined it after the fence trigger was installed, and would not raise the tombstone floor',
                       TG_TABLE_SCHEMA, TG_TABLE_NAME),
      HINT = 'install the fence trigger on the partitioned table again';
  END IF;
  RETURN OLD;
END
$palisade$`,
    // Once per statement, after it (a purge raises the same floor in its own statement: raised twice, the
    // greater wins), and at its end, where the purge raises it: a row trigger would take the floor's row
    // lock at the first row, and two purges of overlapping batches would each wait for the other.
    `CREATE OR REPLACE FUNCTION ${floorFn}() RETURNS trigger LANGUAGE plpgsql AS $palisade$
BEGIN
  INSERT INTO palisade.tombstone_floors (fenced_table, floor)
    SELECT palisade.floor_table(TG_RELID::regclass), max(gone.last_fence) FROM palisade_gone gone HAVING count(*) > 0
    ON CONFLICT (fenced_table) DO UPDATE SET floor = greatest(palisade.tombstone_floors.floor, excluded.floor);
  RETURN NULL;
END
$palisade$`,
    ...dropFenceTriggerStatements({ name, ...(schema === undefined ? {} : { schema }) }),
    `CREATE TRIGGER ${updateTrigger} BEFORE UPDATE ON ${qualified} FOR EACH ROW EXECUTE FUNCTION ${fn}('${sameFence}')`,
  ];
  if (guardDeletes) {
    statements.push(
      `CREATE TRIGGER ${deleteTrigger} BEFORE DELETE ON ${qualified} FOR EACH ROW EXECUTE FUNCTION ${fn}()`,
      onEveryMember(
        qualified,
        `EXECUTE format('CREATE TRIGGER %I AFTER DELETE ON %s REFERENCING OLD TABLE AS palisade_gone FOR EACH STATEMENT EXECUTE FUNCTION %s()', ${literal(FLOOR_TRIGGER_NAME)}, member, ${literal(floorFn)});`,
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
    onEveryMember(
      qualified,
      `EXECUTE format('DROP TRIGGER IF EXISTS %I ON %s', ${literal(FLOOR_TRIGGER_NAME)}, member);`,
    ),
  ];
}

/**
 * A `DO` block that runs `action` (PL/pgSQL, with `member` bound) for the
 * table and each table of its partition tree as it stands now. The floor
 * trigger goes on every one of them: a statement trigger fires only on the
 * table a statement names, and Postgres clones only row triggers to
 * partitions — with the trigger on the parent alone, a `DELETE` through a
 * partition's own name removed tombstones and raised no floor. Foreign
 * tables are skipped (they take no transition tables).
 */
function onEveryMember(qualified: string, action: string): string {
  const table = `${literal(qualified)}::regclass`;
  const body = `
DECLARE member regclass;
BEGIN
  FOR member IN
    SELECT tree.t FROM (SELECT ${table} AS t UNION SELECT relid FROM pg_partition_tree(${table})) tree
    JOIN pg_catalog.pg_class c ON c.oid = tree.t WHERE c.relkind IN ('r', 'p')
  LOOP
    ${action}
  END LOOP;
END
`;
  // A dollar-quote tag that the body (which holds the table's name) does not contain.
  let tag = '$palisade$';
  for (let i = 1; body.includes(tag); i++) tag = `$palisade${i}$`;
  return `DO ${tag}${body}${tag}`;
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
