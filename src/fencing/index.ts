export { type AdvisoryLockOptions, advisoryKey, advisoryLockManager, type LeaderRun, runIfLeader } from './advisory.js';
export type { Grant, GrantOptions, LockBackend, LockInfo } from './backend.js';
export type { LockEvents } from './events.js';
export { assertFence, type Fence, isFence, MAX_FENCE, toFence } from './fence.js';
export type { Lease } from './lease.js';
export { createLockManager, type LockManager, type LockManagerHooks } from './lock-manager.js';
export { type AcquireOptions, MAX_NAME_BYTES, MAX_TTL_MS } from './options.js';
export { type PostgresLockOptions, postgresLockManager } from './postgres.js';
export {
  CommandTimeoutError,
  REDIS_QUEUE_STALE_MS,
  type RedisClient,
  type RedisLockManagerOptions,
  splitRedisFence,
} from './redis.js';
export { redisLockManager } from './redis-manager.js';
