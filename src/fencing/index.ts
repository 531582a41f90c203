export {
  type AdvisoryLockOptions,
  advisoryKey,
  advisoryKeyParts,
  advisoryLockBackend,
  advisoryLockManager,
  type LeaderRun,
  runIfLeader,
} from './advisory.js';
export type { Grant, LockBackend, LockInfo } from './backend.js';
export type { LockEvents } from './events.js';
export { assertFence, type Fence, isFence, MAX_FENCE, toFence } from './fence.js';
export type { Lease } from './lease.js';
export { createLockManager, type LockManager } from './lock-manager.js';
export { type AcquireOptions, checkLockName, checkTtl, MAX_NAME_BYTES, MAX_TTL_MS } from './options.js';
export { type PostgresLockOptions, postgresLockBackend, postgresLockManager } from './postgres.js';
export {
  CommandTimeoutError,
  REDIS_COUNTER_BITS,
  REDIS_MAX_COUNTER,
  REDIS_MAX_EPOCH,
  type RedisClient,
  type RedisKeyNames,
  type RedisLockManagerOptions,
  redisKeyNames,
  redisLockBackend,
  redisLockManager,
  splitRedisFence,
} from './redis.js';
export { checkFenceSequence, FENCE_SEQUENCE } from './sequence.js';
