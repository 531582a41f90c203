/**
 * Where the Redis backend keeps its state, and how a fence splits into epoch
 * and counter. The README (Lock managers → Redis) is the manual.
 *
 * Every key of a namespace carries the hash tag `{palisade:<namespace>}`, so
 * a script's keys share one Redis Cluster slot (no CROSSSLOT):
 *
 * - `{palisade:<ns>}:lock:<name>` — the lock, with the TTL: a string holding the owner's token
 *   and its grant record — fence, grant time, holder (./scripts/record.ts).
 * - `{palisade:<ns>}:fence` — the fence state: epoch, counter, data history (`master_replid`).
 * - `{palisade:<ns>}:queue:<name>` — the waiters in line: a sorted set of token → place (1, 2, …).
 * - `{palisade:<ns>}:seen:<name>` — when each waiter last retried: token → Redis `TIME` in ms.
 * - channel `{palisade:<ns>}:released` — the release script publishes the lock name here,
 *   followed by NUL and the SHA-1 of the live head of the line's token, if any.
 *
 * The namespace is restricted to `[A-Za-z0-9_.-]`, so it cannot close the
 * hash tag early; the lock name only ever follows a fixed `:lock:`,
 * `:queue:` or `:seen:` prefix after the closing `}`, so a name
 * with `{`, `}` or `:` neither moves the hash tag nor collides with a key of
 * another type.
 *
 * A fence is `epoch << 39 | counter` (a 24-bit epoch above a 39-bit
 * counter: every fence fits in 2^63 − 1 and compares by epoch, then
 * counter).
 */
import { FenceSourceError } from '../../../errors.js';
import { type Fence, toFence } from '../../fence.js';
import { checkNamespace } from '../../options.js';

/** Bits of a Redis fence below the epoch. */
export const REDIS_COUNTER_BITS = 39;
/** The highest epoch a Redis fence can carry: 2^24 − 1. */
export const REDIS_MAX_EPOCH = (1n << 24n) - 1n;
/** The highest counter within one epoch: 2^39 − 1; the next grant takes a new epoch. */
export const REDIS_MAX_COUNTER = (1n << BigInt(REDIS_COUNTER_BITS)) - 1n;
/** {@link REDIS_MAX_COUNTER} as the scripts take it. */
export const REDIS_MAX_COUNTER_ARG = REDIS_MAX_COUNTER.toString();

/** The Redis keys and channel of one namespace (for operators and tests). */
export interface RedisKeyNames {
  /** The fence state hash. */
  readonly fence: string;
  /** The channel the release script publishes released lock names on. */
  readonly channel: string;
  /** The lock key of a (validated, NFC) lock name. */
  lock(name: string): string;
  /** The waiters in line for a lock name: a sorted set, token → place. */
  queue(name: string): string;
  /** When each queued waiter of a lock name last retried: a sorted set, token → Redis time in ms. */
  seen(name: string): string;
}

/**
 * The keys palisade uses for `namespace` in Redis.
 * @throws {InvalidArgumentError} for a namespace outside `[A-Za-z0-9_.-]{1,100}`.
 */
export function redisKeyNames(namespace: string): RedisKeyNames {
  checkNamespace(namespace);
  const tag = `{palisade:${namespace}}`;
  return {
    fence: `${tag}:fence`,
    channel: `${tag}:released`,
    lock: (name) => `${tag}:lock:${name}`,
    queue: (name) => `${tag}:queue:${name}`,
    seen: (name) => `${tag}:seen:${name}`,
  };
}

/** Splits a fence issued by the Redis backend into its epoch and counter. */
export function splitRedisFence(fence: Fence): { epoch: bigint; counter: bigint } {
  return { epoch: fence >> BigInt(REDIS_COUNTER_BITS), counter: fence & REDIS_MAX_COUNTER };
}

const DIGITS = /^\d{1,20}$/;

/**
 * @internal The fence of an epoch and a counter as a script replied them.
 * @throws {FenceSourceError} for a malformed or out-of-range reply.
 */
export function fenceOf(epoch: unknown, counter: unknown): Fence {
  if (typeof epoch !== 'string' || typeof counter !== 'string' || !DIGITS.test(epoch) || !DIGITS.test(counter)) {
    throw new FenceSourceError(`Redis returned a malformed fence (${String(epoch)}, ${String(counter)})`);
  }
  const e = BigInt(epoch);
  const c = BigInt(counter);
  if (e < 1n || e > REDIS_MAX_EPOCH || c < 1n || c > REDIS_MAX_COUNTER) {
    throw new FenceSourceError(`Redis returned a fence out of range (epoch ${e}, counter ${c})`);
  }
  return toFence((e << BigInt(REDIS_COUNTER_BITS)) | c);
}
