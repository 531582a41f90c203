import { RowMissingError, StaleFenceError } from '../errors.js';
import type { Fence } from '../fencing/fence.js';

/**
 * What one fenced write did, learned in the write's own round trip (a
 * second read only when the row changed while the write waited for it):
 *
 * - `applied` — the row now carries this fence; `row` is the row as written.
 * - `stale` — a higher fence already wrote the row (or deleted it, for an
 *   upsert); `currentFence` is that fence. For an upsert of a row that does
 *   not exist, the table's tombstone floor at or above this fence (see
 *   `purgeTombstones`). Nothing was written.
 * - `duplicate` — this very fence already wrote this row: a retry of a write
 *   that landed. Never for a write that found no live row. Nothing was
 *   written.
 * - `missing` — no live row has this key (absent, or a tombstone). Nothing
 *   was written, no fence moved: a later upsert by the same fence applies.
 */
export type WriteResult<Row> =
  | { readonly status: 'applied'; readonly row: Row }
  | { readonly status: 'stale'; readonly currentFence: Fence }
  | { readonly status: 'duplicate' }
  | { readonly status: 'missing' };

/** What a fenced multi-row update did. `stale` counts rows at or above the fence. */
export interface BatchResult {
  readonly applied: number;
  readonly stale: number;
}

interface WriteContext {
  readonly table: string;
  readonly key: Readonly<Record<string, unknown>>;
  readonly fence: bigint;
}

// Results stay plain `{ status }` objects; what mustApply needs for its error
// rides alongside, keyed by the result object itself.
const contexts = new WeakMap<object, WriteContext>();

/** @internal Called by the repository for every result it returns. */
export function rememberContext(result: object, context: WriteContext): void {
  contexts.set(result, context);
}

/**
 * Returns the written row, or throws: {@link StaleFenceError} (table, key,
 * attempted and current fence) for `stale` and `duplicate`,
 * {@link RowMissingError} for `missing`. For callers who treat a refused
 * write as exceptional: `const row = mustApply(await repo.update(k, f, p))`.
 */
export function mustApply<Row>(result: WriteResult<Row>): Row {
  const context = contexts.get(result) ?? { table: '(unknown table)', key: {}, fence: 0n };
  switch (result.status) {
    case 'applied':
      return result.row;
    case 'stale':
      throw new StaleFenceError(context.table, context.key, context.fence, result.currentFence);
    case 'duplicate':
      throw new StaleFenceError(context.table, context.key, context.fence, context.fence);
    case 'missing':
      throw new RowMissingError(context.table);
  }
}

/**
 * @internal `fn`, with a throw turned into a rejected promise: bad input
 * rejects, as every write's outcome arrives, without the extra promise and
 * turns of the microtask queue an `async` wrapper costs on every call.
 */
export function rejecting<A extends unknown[], R>(fn: (...args: A) => Promise<R>): (...args: A) => Promise<R> {
  return (...args) => {
    try {
      return fn(...args);
    } catch (err) {
      return Promise.reject(err);
    }
  };
}
