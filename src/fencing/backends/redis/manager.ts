/**
 * The public `redisLockManager`: the Redis backend (./redis.ts) under the
 * shared lock manager, plus what only the client knows — why it is not
 * connected. With `enableOfflineQueue: false` ioredis answers a command sent
 * while disconnected with "Stream isn't writeable…", which says nothing of
 * the cause; its `error` events do ("connect ECONNREFUSED 127.0.0.1:6379").
 */
import { forwardTo } from '../../backend.js';
import { checkClaimRegisters, withEagerClaim } from '../../eager-claim.js';
import { createLockManager, type LockManager } from '../../lock-manager.js';
import { checkNamespace } from '../../options.js';
import { type RedisClient, type RedisLockManagerOptions, redisLockBackend } from './backend.js';

/** How often a queued waiter retries: well inside REDIS_HANDOFF_RECENT_MS (500) and REDIS_QUEUE_STALE_MS (1,000). */
const QUEUED_RETRY_MS = { min: 100, max: 200 } as const;

/**
 * A lock manager on Redis (ioredis). Each grant is one Lua script: the lock
 * key (the token and its grant record, with the TTL) and the fence counter
 * increment, atomic.
 *
 * Guarantees:
 * - fences of a namespace strictly increase across all its lock names, and
 *   — with `epochs` — the first fence after any change of the data history
 *   (restart without persistence or from an older snapshot, flush,
 *   eviction, failover, failback, a resync followed by a promotion) is above
 *   every fence issued before it; many namespaces recover at once without
 *   waiting for each other;
 * - a replica grants nothing (`FenceSourceError`), even a writable one;
 * - the grant is idempotent per token (a re-sent grant returns the same
 *   fence); release and extend act only for the token that holds the lock;
 * - no Redis command or Postgres statement waits longer than
 *   `commandTimeoutMs`; waiters wake on a release (pub/sub), else poll;
 * - a fair order among the waiting `acquire` calls of one lock name in one
 *   namespace on one Redis: first come (first found the lock taken), first
 *   served; `tryAcquire` does not jump the line (see "Fair order" above).
 *
 * Does not guarantee:
 * - mutual exclusion. A lease can expire while its holder is paused; a
 *   flush, an eviction or a failover drops lock keys so two holders can
 *   overlap. Only the fence, checked by the resource (a fenced
 *   repository), refuses the stale holder's write. Run Redis with
 *   `maxmemory-policy noeviction` (lock keys carry TTLs, so `volatile-*`
 *   policies evict them first);
 * - monotonic fences when the Postgres epoch sequence itself goes back
 *   (a restore of an old backup), when managers of one namespace use
 *   different Redis servers or different Postgres databases, when someone
 *   edits palisade's keys by hand (or an in-place reload such as `DEBUG
 *   RELOAD` of an older file keeps the data history), or without
 *   `epochs` and with `allowFreshCounter` (see there);
 * - a single order across a split brain: an old primary cut off by a
 *   failover may keep granting fences of its old epoch — below the new
 *   primary's, so its holders lose every row the new holders wrote (the
 *   safe direction) — until it is demoted (`min-replicas-to-write` bounds
 *   that window). If the old primary loses its counter during the split,
 *   its new epoch is above the new primary's: the new primary's holders are
 *   then refused (never applied stale) on rows the old one's holders wrote,
 *   until the new primary's next epoch;
 * - that `release()` says `'released'` when ioredis re-sent a release
 *   whose reply was lost: the second run finds the lock gone and says
 *   `'lost'` (the lock is free either way);
 * - a wake-up on expiry (Redis does not publish it): waiters then poll;
 * - a waiter's place in line when it stops retrying for more than
 *   {@link REDIS_QUEUE_STALE_MS} (a long pause, an event loop blocked, a
 *   grant that took that long): it queues again at the end. The order is
 *   per lock name only (not across the names of `acquireAll`), and is lost
 *   with the queue keys (a flush, a failover, a restart without persistence);
 *   clients of an older palisade, whose grant script knows no queue, ignore it.
 *
 * Needs: Redis ≥ 6 (scripts call `INFO`, `TIME`, `PUBLISH`; an ACL user
 * needs them), a single node, primary/replicas, or a Redis Cluster (an
 * ioredis `Cluster`: a namespace's keys share one slot; a failover to a
 * replica changes the data history, so the next grant takes a new
 * epoch). Epoch recovery takes three round trips (two to Redis, one to
 * Postgres) and may make a grant wait, bounded, while another client of the
 * namespace finishes installing an epoch; it is not counted in `waitMs`.
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
  const inner = redisLockBackend(options);
  const namespace = checkNamespace(options.namespace);
  // With `epochs` each grant names its epoch's source (./backend.ts), and the namespace makes the lease's
  // lock; without, leases carry no lock (README, "Two scopes of fencing").
  const backend = withEagerClaim(
    options.epochs === undefined ? inner : forwardTo(inner, namespace),
    checkClaimRegisters(options.claimRegisters),
  );
  const watch = watchConnection(options.client);
  return createLockManager(
    {
      ...backend,
      async close() {
        watch.stop();
        await backend.close();
      },
    },
    // Waiters get their turn by a handoff; a retry only keeps their place (and the handoff's
    // "seen within REDIS_HANDOFF_RECENT_MS"): fewer, evenly spaced retries halve the commands per
    // critical section under contention (bench/results, section 3).
    { lastConnectionError: watch.last, queuedRetryMs: QUEUED_RETRY_MS },
  );
}

interface ConnectionWatch {
  last: unknown;
  users: number;
  stop(): void;
}

// One pair of listeners per client, however many managers share it: a listener per manager made
// Node warn of a leak (MaxListenersExceededWarning) from the 11th manager on one client.
const watches = new WeakMap<RedisClient, ConnectionWatch>();

function watchConnection(client: RedisClient): { last: () => unknown; stop: () => void } {
  let watch = watches.get(client);
  if (!watch) {
    const events = client as unknown as {
      on(event: string, fn: (arg?: unknown) => void): unknown;
      off(event: string, fn: (arg?: unknown) => void): unknown;
    };
    const shared: ConnectionWatch = {
      last: undefined,
      users: 0,
      stop() {
        events.off('error', onError);
        events.off('ready', onReady);
        watches.delete(client);
      },
    };
    const onError = (err: unknown) => {
      shared.last = err;
    };
    const onReady = () => {
      shared.last = undefined;
    };
    events.on('error', onError);
    events.on('ready', onReady);
    watches.set(client, shared);
    watch = shared;
  }
  const mine = watch;
  mine.users++;
  let stopped = false;
  return {
    last: () => mine.last,
    stop: () => {
      if (stopped) return;
      stopped = true;
      if (--mine.users === 0) mine.stop();
    },
  };
}
