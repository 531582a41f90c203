/** The Redis lock backend; the README's "Redis" section is its manual. */
export {
  CommandTimeoutError,
  REDIS_HANDOFF_CONFIRM_MS,
  REDIS_HANDOFF_RECENT_MS,
  REDIS_QUEUE_STALE_MS,
  type RedisClient,
  type RedisLockManagerOptions,
  redisLockBackend,
  splitRedisFence,
} from './backend.js';
export { redisLockManager } from './manager.js';
