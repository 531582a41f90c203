import { InvalidArgumentError } from '../errors.js';

declare const fenceBrand: unique symbol;

/**
 * A fencing token: a positive 64-bit integer (1 … 2^63−1) that strictly
 * increases with every lock grant of one namespace. Branded so that a plain
 * number or bigint cannot be passed where a fence is due by accident.
 */
export type Fence = bigint & { readonly [fenceBrand]: true };

/** The highest fence Postgres `bigint` can store: 2^63 − 1. */
export const MAX_FENCE = (1n << 63n) - 1n;

const CANONICAL_DECIMAL = /^[1-9][0-9]*$/;

/**
 * Checks `value` and brands it as a {@link Fence}. Meant for tests, migration
 * scripts and values read back from storage; lock managers issue fences
 * themselves.
 *
 * Accepts a bigint, a safe-integer number, or a canonical decimal string
 * (no sign, spaces, leading zeros, exponent or radix prefix), in 1 … 2^63−1.
 * Numbers above 2^53 are refused because they were already rounded.
 *
 * @throws {InvalidArgumentError} for anything else.
 */
export function toFence(value: unknown): Fence {
  let n: bigint;
  if (typeof value === 'bigint') {
    n = value;
  } else if (typeof value === 'number') {
    if (!Number.isSafeInteger(value)) {
      throw new InvalidArgumentError(
        `fence must be a safe integer when given as a number (got ${String(value)}); pass a bigint or a decimal string`,
      );
    }
    n = BigInt(value);
  } else if (typeof value === 'string') {
    if (!CANONICAL_DECIMAL.test(value) || value.length > 19) {
      throw new InvalidArgumentError('fence string must be a canonical positive decimal integer');
    }
    n = BigInt(value);
  } else {
    throw new InvalidArgumentError(`fence must be a bigint, number or decimal string (got ${typeName(value)})`);
  }
  if (n < 1n || n > MAX_FENCE) {
    throw new InvalidArgumentError(`fence must be in 1 … 2^63−1 (got ${n})`);
  }
  return n as Fence;
}

/** True when `value` is a bigint in the fence range (no branding check is possible at run time). */
export function isFence(value: unknown): value is Fence {
  return typeof value === 'bigint' && value >= 1n && value <= MAX_FENCE;
}

/** Re-checks a value typed as `Fence` at a public boundary: TypeScript types vanish at run time. */
export function assertFence(value: unknown, what = 'fence'): Fence {
  if (!isFence(value)) {
    throw new InvalidArgumentError(`${what} must be a Fence (a bigint in 1 … 2^63−1); use toFence()`);
  }
  return value;
}

function typeName(value: unknown): string {
  if (value === null) return 'null';
  if (Array.isArray(value)) return 'array';
  return typeof value;
}
