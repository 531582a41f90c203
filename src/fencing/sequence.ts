/**
 * The start-up check of a Postgres sequence that issues fences. A fence
 * source must never hand out a value at or below one it handed out before,
 * and three sequence settings break that silently:
 *
 * - `CACHE n > 1`: each session pre-allocates n values, so a grant in one
 *   session can get a lower value than an earlier grant in another;
 * - `UNLOGGED` (or a temporary sequence): reset after a crash;
 * - `CYCLE`: wraps to the minimum after the maximum.
 *
 * A negative increment counts down, which is just as fatal.
 */
import { type SQL, sql } from 'drizzle-orm';
import { type Database, execute, type RawRow } from '../driver.js';
import { FenceSourceError } from '../errors.js';

/** palisade's fence sequence, created by `migrate()`. */
export const FENCE_SEQUENCE = { schema: 'palisade', name: 'fence_seq' } as const;

/** The query whose single row {@link judgeFenceSequence} judges (no row: the sequence does not exist). */
export function fenceSequenceQuery(schema: string = FENCE_SEQUENCE.schema, name: string = FENCE_SEQUENCE.name): SQL {
  return sql`select s.seqcache::text as cache, s.seqcycle as cycle, s.seqincrement::text as increment,
      c.relpersistence::text as persistence
    from pg_catalog.pg_class c
    join pg_catalog.pg_namespace n on n.oid = c.relnamespace
    join pg_catalog.pg_sequence s on s.seqrelid = c.oid
    where n.nspname = ${schema}::text and c.relname = ${name}::text and c.relkind = 'S'`;
}

/**
 * Throws unless `row` (from {@link fenceSequenceQuery}) shows a logged,
 * ascending, `CACHE 1`, `NO CYCLE` sequence.
 * @throws {FenceSourceError} naming what is wrong and how to fix it.
 */
export function judgeFenceSequence(row: RawRow | undefined, qualifiedName = 'palisade.fence_seq'): void {
  if (!row) {
    throw new FenceSourceError(`fence sequence ${qualifiedName} does not exist: run palisade's migrate(db) first`);
  }
  const problems: string[] = [];
  if (String(row.cache) !== '1') problems.push(`CACHE ${String(row.cache)} (must be CACHE 1)`);
  if (row.cycle === true || row.cycle === 't') problems.push('CYCLE (must be NO CYCLE)');
  if (String(row.persistence) !== 'p') {
    problems.push(`${row.persistence === 'u' ? 'UNLOGGED' : 'TEMPORARY'} (must be logged)`);
  }
  if (!/^[1-9][0-9]*$/.test(String(row.increment))) {
    problems.push(`INCREMENT BY ${String(row.increment)} (must be positive)`);
  }
  if (problems.length > 0) {
    throw new FenceSourceError(
      `fence sequence ${qualifiedName} is unsafe: ${problems.join(', ')}; ` +
        `it could issue a fence at or below one it issued before. Fix it with ALTER SEQUENCE ${qualifiedName} CACHE 1 NO CYCLE; ALTER SEQUENCE ${qualifiedName} SET LOGGED`,
    );
  }
}

/**
 * Checks palisade's fence sequence (or another one) on a drizzle database.
 * One round trip. Guarantees the settings at the moment of the check only:
 * an `ALTER SEQUENCE` afterwards is not noticed until the next check.
 * @throws {FenceSourceError} if the sequence is missing or unsafe.
 */
export async function checkFenceSequence(
  db: Database,
  schema: string = FENCE_SEQUENCE.schema,
  name: string = FENCE_SEQUENCE.name,
): Promise<void> {
  const [row] = await execute(db, fenceSequenceQuery(schema, name));
  judgeFenceSequence(row, `${schema}.${name}`);
}
