import { sql } from 'drizzle-orm';
import { bigint, timestamp } from 'drizzle-orm/pg-core';

/**
 * The columns that make a table fenced. Spread them into any drizzle
 * `pgTable`:
 *
 * ```ts
 * const accounts = pgTable('accounts', {
 *   id: text('id').primaryKey(),
 *   balance: integer('balance').notNull(),
 *   ...fenceColumns(),
 * });
 * ```
 *
 * - `last_fence bigint NOT NULL DEFAULT 0` — the highest fence that wrote the
 *   row. `0` is below every fence, so any holder may write a fresh row once.
 * - `deleted_at timestamptz` — set on delete instead of removing the row: the
 *   tombstone keeps `last_fence`, so a stale writer cannot resurrect the row.
 *
 * The default is SQL, not `0n`: drizzle-kit 0.31 cannot serialise a bigint
 * default and crashes in `generate`.
 */
export function fenceColumns() {
  return {
    lastFence: bigint('last_fence', { mode: 'bigint' }).notNull().default(sql`0`),
    deletedAt: timestamp('deleted_at', { withTimezone: true, mode: 'date' }),
  };
}

/** Database column names of {@link fenceColumns}; callers may not set them in a patch. */
export const FENCE_COLUMN_NAMES = ['last_fence', 'deleted_at'] as const;
