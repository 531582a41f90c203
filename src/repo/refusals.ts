/**
 * Why a fenced write did not apply (README, "The write path"): the serial
 * outcome — `stale`, `duplicate` or `missing` — from what the refusal
 * statement read beside its write, or from the row read again when it
 * changed while the write waited; and the report of each refusal (its
 * context for `mustApply`, the refusal log of a joined transaction, the
 * repository's `onStale`).
 */
import { sql } from 'drizzle-orm';
import { type Database, execute, int8, type RawRow } from '../driver.js';
import { RetryableWriteError } from '../errors.js';
import type { Fence } from '../fencing/fence.js';
import { recordRefusal } from './joined.js';
import type { StaleWriteEvent } from './repository-api.js';
import { rememberContext, type WriteResult } from './result.js';
import { FLOOR, PREV_DELETED, PREV_FENCE, type SameFence } from './statements.js';
import { floorSql, type KeyEntries, keyWhere, type TableInfo } from './table.js';

/** @internal The refusal logic of one repository: its table, its fence comparison, its observer. */
export function refusals<Row>(
  info: TableInfo,
  same: SameFence,
  onStale: ((event: StaleWriteEvent) => void) | undefined,
) {
  const t = info.table;

  async function explain(on: Database, method: string, raw: RawRow, key: KeyEntries, fence: Fence) {
    let result = classify(method, raw, fence);
    if (result === 'race') result = await reclassify(on, method, key, fence);
    return report(result, key, fence);
  }

  // The serial model (README, "The write path"): update, modify and delete write a LIVE row whose
  // fence is below theirs; a tombstone or an absent row is `missing` and nothing is written. An
  // upsert writes a live row or a tombstone below its fence, and creates an absent row only above
  // the table's tombstone floor. `stale` names the fence that refused; `duplicate` means this very
  // fence wrote the row. The statement decides on one row version; the previous row read beside it
  // (the statement's snapshot) explains a refusal, unless the row changed while the statement waited
  // for its lock: then the row is read again and the refusal explained by that later state.
  function classify(method: string, raw: RawRow, fence: Fence): WriteResult<Row> | 'race' {
    const prevFence = int8(raw[PREV_FENCE]);
    const prevDeleted = raw[PREV_DELETED] === true;
    if (method !== 'upsert') {
      // Not live in the snapshot: the write's WHERE excluded the row without waiting for it.
      if (prevFence === null || prevDeleted) return { status: 'missing' };
      return refusal(prevFence, fence) ?? 'race';
    }
    if (prevFence === null) {
      // Absent from the snapshot: the insert was not attempted when the floor refused the fence.
      const floor = int8(raw[FLOOR]);
      if (floor !== null && !writable(floor, fence)) return { status: 'stale', currentFence: floor as Fence };
    }
    // ON CONFLICT decided on the newest row version, which may be newer than the snapshot's: a
    // refusal explained by the snapshot could name the wrong fence (say `duplicate` where a higher
    // fence deleted the row while the upsert waited for it). Read the row again.
    return 'race';
  }

  const writable = (current: bigint, fence: bigint) => (same === 'allow' ? current <= fence : current < fence);

  function refusal(current: bigint, fence: Fence): WriteResult<Row> | undefined {
    if (current > fence) return { status: 'stale', currentFence: current as Fence };
    if (current === fence && same === 'reject') return { status: 'duplicate' };
    return undefined;
  }

  async function reclassify(on: Database, method: string, key: KeyEntries, fence: Fence) {
    // One statement, one snapshot: the row and — for an upsert, which an absent row refuses by it —
    // the table's tombstone floor.
    const floor = method === 'upsert' ? floorSql(info) : sql`null::bigint`;
    const [read] = await execute(
      on,
      sql`select r.fence, r.deleted, ${floor} as floor from (select 1) as palisade_one left join
        (select ${t.lastFence} as fence, ${t.deletedAt} is not null as deleted from ${t} where ${keyWhere(info, key)}) as r on true`,
    );
    const current = int8(read?.fence);
    if (method !== 'upsert' && (current === null || read?.deleted === true)) return { status: 'missing' } as const;
    // Fences of a row only rise while it exists, so a refusal by the row as it is now is also a
    // refusal by the version that decided: the write is placed (serially) at this read.
    let refused = current === null ? undefined : refusal(current, fence);
    if (current === null && method === 'upsert') {
      const floorFence = int8(read?.floor);
      if (floorFence !== null && !writable(floorFence, fence)) {
        refused = { status: 'stale', currentFence: floorFence as Fence };
      }
    }
    if (refused) return refused;
    // Writable now, yet the write did not apply (the row changed again since, or a purge removed
    // it): no serial explanation is at hand, so the caller retries.
    throw new RetryableWriteError('race', undefined);
  }

  function report(result: WriteResult<Row>, key: KeyEntries, fence: Fence) {
    const keyObject = Object.fromEntries(key);
    rememberContext(result, { table: info.label, key: keyObject, fence });
    if (result.status === 'stale' || result.status === 'duplicate') {
      const currentFence = result.status === 'stale' ? result.currentFence : fence;
      recordRefusal({ status: result.status, table: info.label, key: keyObject, attemptedFence: fence, currentFence });
    }
    if (onStale && (result.status === 'stale' || result.status === 'duplicate')) {
      const currentFence = result.status === 'stale' ? result.currentFence : fence;
      try {
        onStale({ table: info.label, key: keyObject, attemptedFence: fence, currentFence });
      } catch {
        // An observer must not turn a correct refusal into a failure.
      }
    }
    return result;
  }

  const lockRefusal = (key: KeyEntries, fence: Fence, currentFence: Fence) =>
    report({ status: 'stale', currentFence }, key, fence);

  return { explain, refusal, report, lockRefusal };
}
