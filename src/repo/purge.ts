/**
 * Removing tombstones for good (README, "The write path", purging
 * tombstones): one statement deletes a batch and raises the table's
 * tombstone floor in the same transaction.
 */
import { lt, type SQL, sql } from 'drizzle-orm';
import { InvalidArgumentError } from '../errors.js';
import type { TableInfo } from './table.js';

/**
 * The first key of the advisory locks purges take (`pg_advisory_xact_lock(int, int)`; the second
 * key is the oid of a table that holds a floor). `'pali'` in ASCII; palisade's advisory lock
 * manager takes one-key (`bigint`) locks, a separate key space.
 */
export const PURGE_LOCK_CLASS = 0x70616c69;

/**
 * The purge of up to `batchSize` tombstones deleted before `olderThan`; its
 * one result row's `n` counts them.
 * @throws {InvalidArgumentError} for an invalid date or batch size.
 */
export function purgeStatement(info: TableInfo, olderThan: unknown, batchSize: unknown): SQL {
  if (!(olderThan instanceof Date) || Number.isNaN(olderThan.getTime())) {
    throw new InvalidArgumentError('olderThan must be a valid Date');
  }
  if (!Number.isSafeInteger(batchSize) || (batchSize as number) < 1)
    throw new InvalidArgumentError('batchSize must be a positive integer');
  const t = info.table;
  // Purges of one table take turns: each first locks the floor of every table it can delete from
  // (this one and every partition or inheritance child below it), in oid order. Two purges whose
  // batches overlap otherwise deadlock: a delete visits its rows in its plan's order (a hash of the
  // batch, partition after partition), and two purges — one through a partition and one through the
  // parent, or two batches of different sizes — disagree about it. Writers take no such lock.
  // The floor rises to the highest fence among the tombstones that go, in the same transaction, so
  // no moment exists in which a lower fence could recreate a row. It is the floor of the table each
  // row was in (its partition tree's root: palisade.floor_table), whichever table this repository
  // names. The delete re-checks `ctid` on the row it waited for: a tombstone resurrected meanwhile
  // has a new version (a new ctid) and stays.
  // A ctid names a row only within one partition (or inheritance child): each is matched with its
  // `tableoid` (the join runs as a TID scan). `ctid = any(…)` stays as a plain filter, the condition
  // Postgres re-evaluates on the newest version of a row it waited for.
  return sql`with recursive tree as (
      select ${info.regclass}::oid as rel
      union select i.inhrelid from pg_catalog.pg_inherits i join tree on i.inhparent = tree.rel
    ),
    turn as materialized (
      select count(pg_advisory_xact_lock(${sql.raw(String(PURGE_LOCK_CLASS))}, (floor_rel::int8)::bit(32)::int4)) as n
      from (select distinct palisade.floor_table(rel::regclass)::oid as floor_rel from tree order by 1 offset 0) floors
    ),
    picked as materialized (
      select tableoid as palisade_table, ctid as palisade_row from ${t}
      where (select n from turn) > 0 and ${lt(t.deletedAt, olderThan)} limit ${batchSize}
    ),
    gone as (delete from ${t} where ctid = any(array(select palisade_row from picked))
      and (tableoid, ctid) in (select palisade_table, palisade_row from picked)
      returning tableoid as palisade_table, ${t.lastFence} as fence),
    raised as (insert into palisade.tombstone_floors (fenced_table, floor)
      select palisade.floor_table(palisade_table::regclass), max(fence) from gone group by 1
      on conflict (fenced_table) do update set floor = greatest(palisade.tombstone_floors.floor, excluded.floor))
    select count(*) as n from gone`;
}
