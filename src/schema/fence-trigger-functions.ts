/**
 * The fence trigger's two PL/pgSQL functions, as SQL text: the guard of
 * updates and deletes, and the tombstone floor's statement triggers. What
 * they refuse and why: README, "Adding fencing to an existing table".
 */
import { FENCE_TRIGGER_SQLSTATE } from './fence-trigger.js';

// A trigger function runs under the firing session's search path unless it sets its own: a writer's schema
// first on it would choose the checks' operators (a `<` on bigint that is never true) and pass them all.
const SEARCH_PATH = 'SET search_path = pg_catalog, pg_temp';

/** @internal `CREATE OR REPLACE FUNCTION` of the guard, named `fn` (quoted, maybe qualified). */
export const guardFunctionSql = (fn: string): string =>
  `CREATE OR REPLACE FUNCTION ${fn}() RETURNS trigger LANGUAGE plpgsql ${SEARCH_PATH} AS $palisade$
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
$palisade$`;

// The statement triggers of a DELETE. Before it, the open DELETEs of its table's floor count one more
// (transaction-local): the row trigger above leaves the floor to their ends, noting the fences of rows that
// statements nested in one delete meanwhile as pending. After it, the floor rises once to the highest fence
// removed, at the end, as a purge's does: raised at the first row, two purges of overlapping batches would
// wait for each other's floor row lock. Counted per floor, not stacked: one query's DELETEs of several
// tables (data-modifying CTEs) end in no fixed order. The floor each opened is stacked per table: a nested
// DELETE of the same table (a function its WHERE calls) may find another floor (a partition attached
// meanwhile), and in one setting per table it overwrote the outer's, which then closed the wrong floor.
/** @internal `CREATE OR REPLACE FUNCTION` of the floor's statement triggers, named `floorFn`. */
export const floorFunctionSql = (floorFn: string): string =>
  `CREATE OR REPLACE FUNCTION ${floorFn}() RETURNS trigger LANGUAGE plpgsql ${SEARCH_PATH} AS $palisade$
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
$palisade$`;
