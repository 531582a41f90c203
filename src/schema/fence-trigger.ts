/**
 * The fence trigger: a database-side guard for fenced tables that other
 * writers (psql, a report job, another service) also touch. What it refuses
 * and what every palisade write still does: README, "Adding fencing to an
 * existing table".
 */
import { is } from 'drizzle-orm';
import { getTableConfig, PgTable } from 'drizzle-orm/pg-core';
import { translateError } from '../driver.js';
import { InvalidArgumentError } from '../errors.js';
import { floorFunctionSql, guardFunctionSql } from './fence-trigger-functions.js';

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
 * Idempotent: it replaces the functions and drops the triggers before creating
 * them, in the table's schema (else the first schema of the `search_path`).
 *
 * Guarantees: once installed, no `UPDATE` from any client, role or service
 * leaves `last_fence` where it was or lowers it, or changes a row's primary
 * key, and (by default) no `DELETE` removes a live row: such statements fail
 * with SQLSTATE {@link FENCE_TRIGGER_SQLSTATE} and change nothing. A `DELETE`
 * of tombstones raises the table's tombstone floor, through any name of the
 * table; the deleting role must be allowed to write `palisade.tombstone_floors`
 * (or its delete fails). Run it in one transaction: it drops the triggers
 * before it creates them.
 *
 * Does not (README, "The fence trigger"): check that a raised fence was ever
 * issued (`last_fence = last_fence + 1` passes); guard `INSERT` or `TRUNCATE`;
 * fire when triggers are disabled (the escape hatch for a manual fix); hold
 * against the table's own triggers that set `last_fence`, or that move a
 * tombstone under a name sorting after `~palisade_fence_guard_key`; or
 * against a session that sets palisade's transaction-local settings itself.
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
    // CREATE OR REPLACE keeps a function's owner, who may then change its body: a function of that name that
    // a role owns which the installer may not act as is refused, not taken over.
    catalogBlock(
      qualified,
      [fn, floorFn],
      'owner pg_catalog.regrole;',
      `SELECT p.proowner::regrole INTO owner FROM pg_proc p
   WHERE p.oid = ANY (fns::oid[])
     AND p.proowner <> (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user)
     AND ((SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user) OR NOT pg_has_role(p.proowner, 'MEMBER'))
   LIMIT 1;
  IF owner IS NOT NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
      MESSAGE = format('the fence trigger''s functions exist, owned by %s, who could change them', owner),
      HINT = 'install as that role, or drop the functions first';
  END IF;`,
    ),
    guardFunctionSql(fn),
    floorFunctionSql(floorFn),
    ...dropFenceTriggerStatements({ name, ...(schema === undefined ? {} : { schema }) }),
    `CREATE TRIGGER ${ident(`${FENCE_TRIGGER_NAME}_update`)} BEFORE UPDATE ON ${qualified} FOR EACH ROW EXECUTE FUNCTION ${fn}('${sameFence}')`,
    // The key's columns, fired only when one changed (Postgres evaluates WHEN itself; whatever set it: the
    // statement, or a trigger of the table before this one). A table without a primary key gets none: a fenced
    // repository needs one. Then the row as every BEFORE trigger left it — the table's own may run after the
    // guards and change last_fence, or the key after the key trigger (a name that sorts after it) — checked
    // after the update: the key (a generated one too, which a BEFORE trigger's WHEN may not read) and
    // last_fence. Not instead of the checks before it: a row the update moves to another partition is deleted
    // and inserted there, and fires no AFTER UPDATE trigger. So the install refuses a key column generated in a
    // partition and not in the table (Postgres 15 attaches one): NEW holds no value of it there yet.
    catalogBlock(
      qualified,
      [fn],
      'changed text; every_changed text; generated text;',
      `SELECT string_agg(changes, ' OR ' ORDER BY n) FILTER (WHERE attgenerated = ''),
         string_agg(changes, ' OR ' ORDER BY n),
         min(attname) FILTER (WHERE attgenerated = '' AND EXISTS (
           SELECT FROM pg_partition_tree(tbl) tree
             JOIN pg_attribute m ON m.attrelid = tree.relid AND m.attname = key.attname
            WHERE m.attgenerated <> ''))
    INTO changed, every_changed, generated
    FROM (
      -- Each column compared by its index's own equality, named with its schema and on its own input type
      -- (a writer's \`=\` for the column's own type, say a domain, would match better there).
      SELECT k.n, a.attname, a.attgenerated,
             format('(NEW.%1$I IS NULL OR NOT ((OLD.%1$I)%4$s OPERATOR(%2$I.%3$s) (NEW.%1$I)%4$s))', a.attname,
                    ns.nspname, o.oprname,
                    -- Without a length (-1): char and bit, named without one, would cut the value to one.
                    CASE WHEN ty.typtype = 'p' OR ty.oid = a.atttypid THEN '' ELSE '::' || format_type(ty.oid, -1) END)
      FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
      JOIN pg_opclass c ON c.oid = i.indclass[k.n - 1]
      JOIN pg_type ty ON ty.oid = c.opcintype
      JOIN pg_amop am ON am.amopfamily = c.opcfamily AND am.amopstrategy = 3
        AND am.amoplefttype = c.opcintype AND am.amoprighttype = c.opcintype
      JOIN pg_operator o ON o.oid = am.amopopr
      JOIN pg_namespace ns ON ns.oid = o.oprnamespace
      -- The key's own columns: an index's INCLUDE columns follow them in indkey.
      WHERE i.indrelid = tbl AND i.indisprimary AND k.n <= i.indnkeyatts
    ) key (n, attname, attgenerated, changes);
  IF generated IS NOT NULL THEN
    RAISE EXCEPTION USING
      ERRCODE = 'feature_not_supported',
      MESSAGE = format('the fence trigger cannot guard %s: its key column %I is generated in a partition and not in the table',
                       tbl, generated),
      HINT = 'make the column the same in every partition of the tree';
  END IF;
  IF changed IS NOT NULL THEN
    EXECUTE format('CREATE TRIGGER %I BEFORE UPDATE ON %s FOR EACH ROW WHEN (%s) EXECUTE FUNCTION %s(%L)',
                   ${literal(KEY_TRIGGER_NAME)}, tbl, changed, fns[1], 'key');
  END IF;
  EXECUTE format('CREATE TRIGGER %I AFTER UPDATE ON %s FOR EACH ROW WHEN (%s) EXECUTE FUNCTION %s(%L)',
                 ${literal(AFTER_TRIGGER_NAME)}, tbl,
                 concat_ws(' OR ', every_changed, ${literal(`NEW.last_fence IS NULL OR NEW.last_fence ${sameFence === 'allow' ? '<' : '<='} OLD.last_fence`)}),
                 fns[1], 'after');`,
    ),
  ];
  if (guardDeletes) {
    statements.push(
      `CREATE TRIGGER ${deleteTrigger} BEFORE DELETE ON ${qualified} FOR EACH ROW EXECUTE FUNCTION ${fn}()`,
      onEveryMember(
        qualified,
        `EXECUTE format('CREATE TRIGGER %I BEFORE DELETE ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s()', ${literal(`${FLOOR_TRIGGER_NAME}_before`)}, member, fns[1]);
    EXECUTE format('CREATE TRIGGER %I AFTER DELETE ON %s REFERENCING OLD TABLE AS palisade_gone FOR EACH STATEMENT EXECUTE FUNCTION %s()', ${literal(FLOOR_TRIGGER_NAME)}, member, fns[1]);`,
        [floorFn],
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
function onEveryMember(qualified: string, action: string, functions: string[] = []): string {
  return catalogBlock(
    qualified,
    functions,
    'member regclass;',
    `FOR member IN
    SELECT tree.t FROM (SELECT tbl AS t UNION SELECT relid FROM pg_partition_tree(tbl)) tree
    JOIN pg_class c ON c.oid = tree.t WHERE c.relkind IN ('r', 'p')
  LOOP
    ${action}
  END LOOP;`,
  );
}

/**
 * A `DO` block whose `body` runs with only `pg_catalog` on the search path: an installer's path (`public`
 * first, or on it at all) would let a writer's function or operator there that matches its arguments better
 * than the catalog's (a `format(text, name, name, name)`, an `=(oid, regclass)`) run as the installer or
 * change what is installed. The table is bound to `tbl` and the `functions` (names, without arguments) to
 * `fns` before, by the installer's path, as the statements outside the block resolve them.
 */
function catalogBlock(qualified: string, functions: string[], declare: string, body: string): string {
  const fns = functions.map((f) => `pg_catalog.to_regprocedure(${literal(`${f}()`)})::pg_catalog.regproc`);
  return doBlock(
    `tbl pg_catalog.regclass := ${literal(qualified)}::pg_catalog.regclass;
  fns pg_catalog.regproc[] := ARRAY[${fns.join(', ')}]::pg_catalog.regproc[];
  saved pg_catalog.text := pg_catalog.current_setting('search_path');
  ${declare}`,
    `PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
  ${body}
  PERFORM pg_catalog.set_config('search_path', saved, true);`,
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
 * @throws {InvalidArgumentError} as {@link fenceTriggerSql}, before anything is sent.
 * @throws {DatabaseError} if the table does not exist, lacks `last_fence` / `deleted_at`, or cannot be
 *   guarded (SQLSTATE 0A000: a key column generated in a partition and not in the table).
 */
export async function installFenceTrigger(
  db: Executor,
  table: FenceTriggerTarget,
  options: FenceTriggerOptions = {},
): Promise<void> {
  for (const statement of fenceTriggerStatements(table, options)) {
    await Promise.resolve(db.execute(statement)).catch(rethrow);
  }
}

const rethrow = (err: unknown): never => {
  throw translateError(err);
};

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
