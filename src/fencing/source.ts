/**
 * Fence sources: which counter issued a fence, so that lock registers never
 * compare fences of two counters (README, "Two scopes of fencing").
 */
import { sql } from 'drizzle-orm';
import { type Database, execute, type RawRow, transaction, translateError } from '../driver.js';
import { FenceSourceError } from '../errors.js';
import { sqlStateOf } from '../server-error.js';

/**
 * This database's id as a fence source (`palisade.fence_source_id()`,
 * generated once by palisade's migration 0005): the source of every fence
 * from its `palisade.fence_seq`. With `lockWaitMs`, a lock on
 * `palisade.fence_sources` (an operator's `ALTER TABLE`) is waited for at
 * most that long, on the server (SQLSTATE 55P03 then): in a transaction
 * whose `lock_timeout` is set first, since the function is inlined, and its
 * table locked, when the statement that calls it is planned.
 * @throws {FenceSourceError} when the migration has not run.
 */
export async function databaseSourceId(db: Database, lockWaitMs?: number): Promise<string> {
  const read = (on: Database) => execute(on, sql.raw(SOURCE_ID_SQL));
  return sourceIdFrom(
    lockWaitMs === undefined
      ? read(db)
      : transaction(db, async (tx) => {
          await execute(tx, sql`select set_config('lock_timeout', ${String(lockWaitMs)}::text, true)`);
          return read(tx);
        }),
  );
}

/** @internal The statement that reads the id; its caller sets `lock_timeout` first where the wait is bounded. */
export const SOURCE_ID_SQL = 'select palisade.fence_source_id() as id';

/**
 * @internal The id that {@link SOURCE_ID_SQL}, run by `read`, returned.
 * @throws {FenceSourceError} as {@link readingSourceId} and {@link sourceIdOf}.
 */
export async function sourceIdFrom(read: Promise<readonly RawRow[]>): Promise<string> {
  return sourceIdOf((await readingSourceId(read))[0]);
}

/**
 * @internal `read`, a statement that calls `palisade.fence_source_id()`.
 * @throws {FenceSourceError} when the migrations have not run (no
 * `palisade` schema, no function: SQLSTATE 3F000, 42883); the statement's
 * other errors as palisade's (translateError).
 */
export async function readingSourceId<R>(read: Promise<R>): Promise<R> {
  try {
    return await read;
  } catch (err) {
    const state = sqlStateOf(err);
    if (state === '3F000' || state === '42883') {
      throw new FenceSourceError("the database has no palisade.fence_source_id(): run palisade's migrations (0005)");
    }
    throw translateError(err);
  }
}

/**
 * @internal The fence source id in `row`'s `column`.
 * @throws {FenceSourceError} when it is missing or empty.
 */
export function sourceIdOf(row: RawRow | undefined, column = 'id'): string {
  const id = row?.[column];
  if (typeof id !== 'string' || id.length === 0) {
    throw new FenceSourceError('palisade.fence_sources holds no id: run palisade migration 0005_lock_registers again');
  }
  return id;
}
