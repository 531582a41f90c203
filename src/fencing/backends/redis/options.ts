/**
 * The options of the Redis backend and their checks; the README (Lock
 * managers → Redis) is the manual.
 */
import type { Cluster, Redis } from 'ioredis';
import { type Database, isTransaction } from '../../../driver.js';
import { InvalidArgumentError } from '../../../errors.js';
import type { ClaimRegistersOption } from '../../eager-claim.js';
import { checkCommandTimeout } from '../../options.js';

const DEFAULT_COMMAND_TIMEOUT_MS = 5_000;

/**
 * Any ioredis client, whatever its `replyMapping` (the scripts only reply
 * with strings): one server (`Redis`) or a Redis Cluster (`Cluster`).
 */
export type RedisClient = Redis<'legacy'> | Redis<'resp3'> | Cluster<'legacy'> | Cluster<'resp3'>;

/** Options of `redisLockManager` (./manager.ts). */
export interface RedisLockManagerOptions {
  /**
   * The caller's ioredis client; palisade runs its Lua scripts on it
   * (`EVALSHA`, `EVAL` after a NOSCRIPT) and never closes it.
   * Recommended: `new Redis(url, { commandTimeout: 2000, maxRetriesPerRequest: 1,
   * enableOfflineQueue: false })` so that nothing queues while Redis is away.
   */
  readonly client: RedisClient;
  /** Separates lock sets (and fence counters): 1–100 characters of `[A-Za-z0-9_.-]`. */
  readonly namespace: string;
  /**
   * A drizzle Postgres database where palisade is migrated: the durable floor
   * for fences. When the Redis counter is lost, a new epoch is taken from
   * `palisade.epoch_seq`. Strongly recommended; see {@link allowFreshCounter}.
   * The database, not a transaction (refused).
   */
  readonly epochs?: Database;
  /**
   * Only without `epochs`. `false` (the default): when the counter is missing
   * (a flush, an eviction, a restart without persistence — indistinguishable
   * from the first use of a namespace) or belongs to another data history
   * (a restart, a failover, a failback), grants fail with `FenceSourceError` — nothing
   * in Redis alone can prove the next fence would be above the last.
   * `true`: start a missing counter at epoch 1 and move a foreign one to the
   * next epoch. **Unsafe after a reset**: fences can then go *down*, and a
   * stale holder's write would win. For tests and efficiency-only locks.
   */
  readonly allowFreshCounter?: boolean;
  /**
   * Upper bound for each Redis command and Postgres statement, whatever the
   * client's own `commandTimeout` (default 5,000 ms). A command that times
   * out may still run on the server later: a grant that timed out is
   * released (best effort) and otherwise expires with its TTL.
   */
  readonly commandTimeoutMs?: number;
  /**
   * The eager claim at acquire (README, "When each backend claims"): each
   * grant claims its lock's register in `db`, the fenced tables' database,
   * before `acquire` resolves, so a stale holder is refused on every row
   * before the new holder writes. One statement on `db` per grant. A grant
   * that finds a higher fence there is released and the acquire fails with
   * `FenceSourceError`.
   */
  readonly claimRegisters?: ClaimRegistersOption;
}

/** @internal The options once checked. */
export interface CheckedRedisOptions {
  readonly client: RedisClient;
  readonly namespace: string;
  readonly epochs: Database | undefined;
  readonly allowFresh: boolean;
  readonly timeoutMs: number;
}

/**
 * @internal Checks the options before anything touches Redis.
 * @throws {InvalidArgumentError} for bad options.
 */
export function checkRedisOptions(options: RedisLockManagerOptions): CheckedRedisOptions {
  if (options === null || typeof options !== 'object') throw new InvalidArgumentError('options are required');
  const { client, epochs } = options;
  if (!client || typeof (client as { defineCommand?: unknown }).defineCommand !== 'function') {
    throw new InvalidArgumentError('client must be an ioredis client (Redis or Cluster)');
  }
  if (epochs !== undefined && (epochs === null || typeof epochs.execute !== 'function')) {
    throw new InvalidArgumentError('epochs must be a drizzle Postgres database');
  }
  // What it records is for every process: a transaction would hide it until it commits, or lose it.
  if (epochs !== undefined && isTransaction(epochs)) {
    throw new InvalidArgumentError('epochs must be a drizzle Postgres database, not a transaction');
  }
  const timeoutMs = checkCommandTimeout(options.commandTimeoutMs, DEFAULT_COMMAND_TIMEOUT_MS);
  const allowFresh = options.allowFreshCounter === true;
  if (allowFresh && epochs) throw new InvalidArgumentError('allowFreshCounter only applies without epochs');
  return { client, namespace: options.namespace, epochs, allowFresh, timeoutMs };
}
