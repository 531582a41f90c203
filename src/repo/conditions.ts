/** Conditions (`where`) that callers pass to reads and batch writes. */
import { is, SQL } from 'drizzle-orm';
import { InvalidArgumentError } from '../errors.js';

/**
 * A `where` must be drizzle SQL (`sql\`…\``, `eq(…)`, `and(…)`). Anything
 * else would be bound as a *parameter*: the string `'true'` becomes `where
 * $1` with `$1 = 'true'`, which Postgres casts to boolean — every row.
 */
export function checkCondition(where: unknown, method: string): asserts where is SQL {
  let ok = false;
  if (where !== null && typeof where === 'object' && Object.getPrototypeOf(where) !== null) {
    try {
      ok = is(where, SQL);
    } catch {
      ok = false;
    }
  }
  if (!ok) {
    throw new InvalidArgumentError(
      `${method} needs its condition as drizzle SQL (sql\`…\`, eq(…), and(…)), not a string or other value; pass sql\`true\` for every row`,
    );
  }
}
