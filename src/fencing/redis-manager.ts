/**
 * The public `redisLockManager`: the Redis backend (./redis.ts) under the
 * shared lock manager, plus what only the client knows — why it is not
 * connected. With `enableOfflineQueue: false` ioredis answers a command sent
 * while disconnected with "Stream isn't writeable…", which says nothing of
 * the cause; its `error` events do ("connect ECONNREFUSED 127.0.0.1:6379").
 */
import { createLockManager, type LockManager } from './lock-manager.js';
import { type RedisClient, type RedisLockManagerOptions, redisLockBackend } from './redis.js';

/**
 * A lock manager on Redis (or Redis Cluster) through the caller's ioredis
 * client: see {@link redisLockBackend} for the grant, the fence and what
 * they guarantee.
 *
 * Also guarantees: while Redis cannot be reached, `acquire` retries within
 * `waitMs` and then throws `LockServiceError` (code `lock_service`) saying
 * why — e.g. "connection refused at 127.0.0.1:6379" — with the client's
 * error as the cause; `release()` of a lease it cannot confirm returns
 * `'lost'`. To say why, it listens to the client's `error` and `ready`
 * events until `close()` (a listener also stops ioredis printing
 * "Unhandled error event" for each failed reconnect).
 *
 * Does not: connect, reconnect or close the client — ioredis does that.
 * @throws {InvalidArgumentError} for bad options.
 */
export function redisLockManager(options: RedisLockManagerOptions): LockManager {
  const backend = redisLockBackend(options);
  const watch = watchConnection(options.redis);
  return createLockManager(
    {
      ...backend,
      async close() {
        watch.stop();
        await backend.close();
      },
    },
    { lastConnectionError: watch.last },
  );
}

function watchConnection(client: RedisClient): { last: () => unknown; stop: () => void } {
  let last: unknown;
  const onError = (err: unknown) => {
    last = err;
  };
  const onReady = () => {
    last = undefined;
  };
  const events = client as unknown as {
    on(event: string, fn: (arg?: unknown) => void): unknown;
    off(event: string, fn: (arg?: unknown) => void): unknown;
  };
  events.on('error', onError);
  events.on('ready', onReady);
  return {
    last: () => last,
    stop: () => {
      events.off('error', onError);
      events.off('ready', onReady);
    },
  };
}
