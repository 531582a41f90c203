/**
 * Removing tombstones for good (README, "The write path", purging
 * tombstones): one statement deletes a batch and raises the table's
 * tombstone floor in the same transaction.
 */
import { lt, type SQL, sql } from 'drizzle-orm';
import { InvalidArgumentError } from '../errors.js';
import type { TableInfo } from './table.js';

/** How many batches one `purgeTombstones` call tries while each finds what it chose already gone. */
export const PURGE_ATTEMPTS = 4;

/**
 * The purge of up to `batchSize` tombstones deleted before `olderThan`; its
 * one result row's `n` counts them, `picked` the tombstones it chose (some
 * may be gone by the time it deletes them). `skipLocked`: it chooses, and
 * locks, only tombstones no other transaction holds.
 * @throws {InvalidArgumentError} for an invalid date or batch size.
 */
export function purgeStatement(info: TableInfo, olderThan: unknown, batchSize: unknown, skipLocked = false): SQL {
  if (!(olderThan instanceof Date) || Number.isNaN(olderThan.getTime())) {
    throw new InvalidArgumentError('olderThan must be a valid Date');
  }
  if (!Number.isSafeInteger(batchSize) || (batchSize as number) < 1)
    throw new InvalidArgumentError('batchSize must be a positive integer');
  const t = info.table;
  // The floor rises to the highest fence among the tombstones that go, in the same transaction, so
  // no moment exists in which a lower fence could recreate a row. It is the floor of the table each
  // row was in (its partition tree's root: palisade.floor_table), whichever table this repository
  // names. The delete re-checks `ctid` on the row it waited for: a tombstone resurrected meanwhile
  // has a new version (a new ctid) and stays.
  // A ctid names a row only within one partition (or inheritance child): each is matched with its
  // `tableoid` too. That match is a filter (a hashed sub-plan: `… is true` keeps the planner from
  // turning it into a join) on a scan by `ctid = any(…)`, so every purge deletes in one order —
  // table after table, rows by position — whichever name it goes through and whatever its batch.
  // Deleting in a join's order (a hash of the batch), two purges of overlapping batches — one through
  // a partition and one through the parent — deadlocked. `ctid = any(…)` is also the condition
  // Postgres re-evaluates on the newest version of a row it waited for.
  // `skipLocked` is for a batch after one that found everything it chose gone: another purge was
  // ahead of it on the same rows (it would be again, and again) or writers held them. Locking costs a
  // write per row, so only such a batch pays it.
  // The floor is raised by palisade.raise_floor (migration 0013), a statement of its own, once per table the
  // batch removed rows of: once the DELETE is done (an aggregate over all of `gone`), as a command after every
  // one nested in it — a user's trigger that removes more tombstones makes the fence trigger write the same
  // floor row from such a command, which an INSERT … ON CONFLICT of this statement's own command could not
  // see: Postgres would refuse it (21000).
  // `purging` tells the fence trigger (../schema/fence-trigger.ts) that this statement raises the floor at its
  // end: a row whose statement raises no floor of its own (a partition made after the trigger's install, an
  // inheritance child) would otherwise raise it from its row trigger, taking the floor's row lock at the first
  // row — and two purges of overlapping batches would each wait for the other. The trigger leaves such a
  // row's fence pending to it, as to an open DELETE (`palisade.floor_pending_<floor>`), and lists the floor
  // (`palisade.purge_floors`): its own rows, and rows that code it runs removes (a row security policy's
  // function), which `gone` does not return. A DELETE's end that raised and cleared a pending fence first
  // leaves nothing to raise here.
  // The final projection, once the DELETE is done, first clears the mark — a row removed from here on (by
  // code the raises below run: a policy on the floors table) raises its floor itself — then raises what was
  // left to it and clears that: the mark holds for this statement alone (a mark by statement_timestamp()
  // alone covered the next statement on PGlite, whose clock moves in whole milliseconds). Postgres evaluates
  // the columns in order, the sub-select when its column is.
  return sql`with purging as materialized (
      select set_config('palisade.purging', statement_timestamp()::text, true) as at
    ),
    picked as materialized (
      select tableoid as palisade_table, ctid as palisade_row from ${t} where ${lt(t.deletedAt, olderThan)} and (select at from purging) is not null limit ${batchSize}${skipLocked ? sql` for update skip locked` : sql``}
    ),
    gone as (delete from ${t} where ctid = any(array(select palisade_row from picked))
      and ((tableoid, ctid) in (select palisade_table, palisade_row from picked)) is true
      returning tableoid as palisade_table, ${t.lastFence} as fence),
    removed as (select palisade_table, max(fence) as fence, count(*) as n from gone group by 1)
    select coalesce(sum(n), 0)::int8 as n, (select count(*) from picked) as picked,
      bool_and(palisade.raise_floor(palisade.floor_table(palisade_table::regclass), fence)) as raised,
      set_config('palisade.purging', '', true) as purged,
      (select count(case when palisade.raise_floor(f::oid::regclass, p.fence)
                    then set_config('palisade.floor_pending_' || f, '', true) end)
       from unnest(string_to_array(nullif(current_setting('palisade.purge_floors', true), ''), ' ')) f,
         lateral (select nullif(current_setting('palisade.floor_pending_' || f, true), '')::int8 as fence) p
       where p.fence is not null) as pending,
      set_config('palisade.purge_floors', '', true) as listed
    from removed`;
}
