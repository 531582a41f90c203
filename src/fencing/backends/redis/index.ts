/** The Redis lock backend; the README's "Redis" section is its manual. */
export {
  REDIS_QUEUE_STALE_MS,
  type RedisClient,
  type RedisLockManagerOptions,
  redisLockBackend,
  splitRedisFence,
} from './backend.js';
export { redisLockManager } from './manager.js';
