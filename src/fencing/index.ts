export type { Grant, GrantOptions, LockBackend, LockInfo } from './backend.js';
export {
  type AdvisoryLockManagerOptions,
  advisoryKey,
  advisoryLockManager,
  type LeaderRun,
  runIfLeader,
} from './backends/postgres-advisory/backend.js';
export { type PostgresLockManagerOptions, postgresLockManager } from './backends/postgres-lease/backend.js';
export {
  CommandTimeoutError,
  REDIS_QUEUE_STALE_MS,
  type RedisClient,
  type RedisLockManagerOptions,
  splitRedisFence,
} from './backends/redis/backend.js';
export { redisLockManager } from './backends/redis/manager.js';
export type { LockEvents } from './events.js';
export { assertFence, type Fence, isFence, MAX_FENCE, toFence } from './fence.js';
export type { Lease } from './lease.js';
export { checkLockIdentity, type LockIdentity } from './lock-identity.js';
export { createLockManager, type LockManager, type LockManagerHooks } from './lock-manager.js';
export { type AcquireOptions, MAX_NAME_BYTES, MAX_TTL_MS } from './options.js';
