/**
 * The Redis lock backend: `SET key token NX PX ttl` and the fence counter in
 * one Lua script, on one ioredis client, with fences that never go down even
 * when Redis forgets its counter.
 *
 * ## Keys
 *
 * Every key of a namespace carries the hash tag `{palisade:<namespace>}`, so
 * a script's keys share one Redis Cluster slot (no CROSSSLOT):
 *
 * - `{palisade:<ns>}:lock:<name>` — the lock: a string holding the owner token, with the TTL.
 * - `{palisade:<ns>}:grant:<name>` — what `inspect` shows: token, fence, holder, grant time (same TTL).
 * - `{palisade:<ns>}:fence` — the fence state: epoch, counter, data history (`run_id/master_replid`).
 * - `{palisade:<ns>}:queue:<name>` — the waiters in line: a sorted set of token → place (1, 2, …).
 * - `{palisade:<ns>}:seen:<name>` — when each waiter last retried: token → Redis `TIME` in ms.
 * - channel `{palisade:<ns>}:released` — the release script publishes the lock name here,
 *   followed by NUL and the token of the live waiter at the head of the line, if any.
 *
 * The namespace is restricted to `[A-Za-z0-9_.-]`, so it cannot close the
 * hash tag early; the lock name only ever follows a fixed `:lock:`,
 * `:grant:`, `:queue:` or `:seen:` prefix after the closing `}`, so a name
 * with `{`, `}` or `:` neither moves the hash tag nor collides with a key of
 * another type.
 *
 * ## Fair order
 *
 * A waiting `acquire` keeps one token for the whole wait. When its grant
 * finds the lock held — or free but promised to an earlier waiter — the
 * script puts the token at the end of the lock's queue (or, if it is
 * already there, only notes that it is still alive) and answers BUSY. A
 * release wakes only the head of the line (the other waiters retry at their
 * backoff, at most every 250 ms, which keeps their places). A free
 * lock goes only to the head of the queue; `tryAcquire` gets it only when
 * nobody waits. So among the waiters of one lock name, grants follow the
 * order in which they first found the lock taken, and a releaser that
 * acquires again goes to the back instead of barging in.
 *
 * A waiter that stops retrying (killed, paused, cut off) for longer than
 * {@link REDIS_QUEUE_STALE_MS} loses its place: the next grant drops it, so
 * it delays the lock by at most about that long; if it comes back it queues
 * again at the end. A waiter that gives up (timeout, abort) leaves the queue
 * at once (best effort). The queue keys expire a few seconds after their
 * last write, so nothing stays behind.
 *
 * ## Fences
 *
 * A fence is `epoch << 39 | counter` (a 24-bit epoch above a 39-bit
 * counter: every fence fits in 2^63 − 1 and compares by epoch, then
 * counter). The fence state records the data history it was written on
 * (see IDENTITY below for why `run_id/master_replid` names one); the grant
 * script issues a fence only from an active state of the current history
 * whose counter is not used up. Otherwise the client takes a new epoch:
 *
 * 1. a placeholder in Redis (state pending, the client's nonce), only over a
 *    missing, foreign or used-up state — while it lives nobody else installs;
 * 2. `nextval` of `palisade.epoch_seq` in Postgres, taken only now, so it is
 *    above every epoch taken before — every epoch ever active here included;
 * 3. activation, only if that very placeholder is still there on the same
 *    history (a client that paused past the placeholder's TTL, or across a
 *    flush or a failover, activates nothing and retries).
 *
 * No step compares with other namespaces, so a recovery of many namespaces at
 * once never starves one. The README (Lock managers → Redis, and what each
 * guarantees) is the manual.
 */
import { randomBytes } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { sql } from 'drizzle-orm';
import type { Cluster, Redis } from 'ioredis';
import { type Database, execute, int8 } from '../../../driver.js';
import { CommandTimeoutError, FenceSourceError, InvalidArgumentError } from '../../../errors.js';
import { recordFenceSource } from '../../../telemetry/otel.js';
import type { Grant, LockBackend, LockInfo } from '../../backend.js';
import { type Fence, toFence } from '../../fence.js';
import { checkNamespace } from '../../options.js';
import { ReleaseListener } from '../../release-listener.js';
import { fenceSequenceQuery, judgeFenceSequence } from '../../sequence.js';

/** Bits of a Redis fence below the epoch. */
export const REDIS_COUNTER_BITS = 39;
/** The highest epoch a Redis fence can carry: 2^24 − 1. */
export const REDIS_MAX_EPOCH = (1n << 24n) - 1n;
/** The highest counter within one epoch: 2^39 − 1; the next grant takes a new epoch. */
export const REDIS_MAX_COUNTER = (1n << BigInt(REDIS_COUNTER_BITS)) - 1n;

/**
 * A queued waiter that has not retried for this long (by the Redis server's
 * clock) loses its place in the lock's queue. Waiting acquires retry at
 * least every 250 ms (the lock manager's backoff cap) and at every release.
 */
export const REDIS_QUEUE_STALE_MS = 1_000;
/** The queue keys expire this long after their last write. */
const QUEUE_TTL_MS = REDIS_QUEUE_STALE_MS + 4_000;
/** At most this many dead entries are dropped from a queue per grant (the rest at the next ones). */
const MAX_PRUNE = 64;
const DEFAULT_COMMAND_TIMEOUT_MS = 5_000;
const MAX_GRANT_ROUNDS = 200;

/**
 * Any ioredis client, whatever its `replyMapping` (the scripts only reply
 * with strings): one server (`Redis`) or a Redis Cluster (`Cluster`).
 */
export type RedisClient = Redis<'legacy'> | Redis<'resp3'> | Cluster<'legacy'> | Cluster<'resp3'>;

/** Options of `redisLockManager` (./manager.ts). */
export interface RedisLockManagerOptions {
  /**
   * The caller's ioredis client; palisade defines its scripts on it
   * (`defineCommand`, names starting with `palisade`) and never closes it.
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
}

/** The Redis keys and channel of one namespace (for operators and tests). */
export interface RedisKeyNames {
  /** The fence state hash. */
  readonly fence: string;
  /** The channel the release script publishes released lock names on. */
  readonly channel: string;
  /** The lock key of a (validated, NFC) lock name. */
  lock(name: string): string;
  /** The grant record (what `inspect` shows) of a lock name. */
  grant(name: string): string;
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
    grant: (name) => `${tag}:grant:${name}`,
    queue: (name) => `${tag}:queue:${name}`,
    seen: (name) => `${tag}:seen:${name}`,
  };
}

/** Splits a fence issued by the Redis backend into its epoch and counter. */
export function splitRedisFence(fence: Fence): { epoch: bigint; counter: bigint } {
  return { epoch: fence >> BigInt(REDIS_COUNTER_BITS), counter: fence & REDIS_MAX_COUNTER };
}

type Reply = string[];
type ScriptFn = (...args: (string | number)[]) => Promise<unknown>;

interface Scripts {
  palisadeGrantV3: ScriptFn;
  palisadeLeaveV1: ScriptFn;
  palisadeExtendV1: ScriptFn;
  palisadeReleaseV2: ScriptFn;
  palisadeInspectV1: ScriptFn;
  palisadeInstallEpochV2: ScriptFn;
  palisadeActivateEpochV2: ScriptFn;
  palisadeBumpEpochV2: ScriptFn;
}

// The data history the server's keys belong to, as the script sees it (never
// a client's cached value): `run_id/master_replid`, or false unless the
// server is a primary. Why this names a history, not a process:
// - the fence state only ever changes forward on one primary's dataset
//   (HINCRBY), so a state whose id is the current identity was written on
//   the dataset the server holds now, with every fence it ever issued;
// - a dataset is replaced or forked only by a restart (a new process:
//   run_id changes, even when it reloads an older RDB/AOF), by a flush (the
//   state is gone) or by replication: a server that follows another (full or
//   partial resync) takes its primary's master_replid and, being a replica,
//   grants nothing (role check: a replica reports its primary's replid, and
//   even a writable replica's keys are not its primary's); a promotion —
//   failover, failback, REPLICAOF NO ONE — draws a new random master_replid;
// - so the old primary of a failback (same process, same run_id, but R's
//   dataset after the resync and a new replid after its promotion) and a
//   promoted replica (its primary's state, its own run_id) both see a
//   foreign id and take a new epoch.
// Not covered: an in-place reload (DEBUG RELOAD of an older file) and hand
// edits of palisade's keys keep the identity. Two INFO sections (Redis 6
// has no multi-section INFO); the lock and queue paths never call it.
const IDENTITY = `
local function identity()
  local replication = redis.call('INFO', 'replication')
  if not string.find(replication, 'role:master', 1, true) then return false end
  local replid = string.match(replication, 'master_replid:(%x+)')
  local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
  if not replid or not run then return false end
  return run .. '/' .. replid
end
`;

// KEYS: lock, grant record, fence state, queue, seen.
// ARGV: token, ttl ms, holder, has holder ('1'/'0'), max counter, waiting ('1'/'0'), stale ms, queue ttl ms, max prune.
// Replies: {'OK', epoch, counter} | {'BUSY'} | {'NOEPOCH', reason, observed epoch}.
// The queue: KEYS[4] token → place (order of arrival), KEYS[5] token → last retry (Redis TIME, ms).
const GRANT = `${IDENTITY}
local waiting = ARGV[6] == '1'
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function wait_in_line(ms)
  if not redis.call('ZSCORE', KEYS[4], ARGV[1]) then
    local last = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')
    local place = 1
    if last[2] then place = tonumber(last[2]) + 1 end
    redis.call('ZADD', KEYS[4], place, ARGV[1])
  end
  redis.call('ZADD', KEYS[5], ms, ARGV[1])
  redis.call('PEXPIRE', KEYS[4], ARGV[8])
  redis.call('PEXPIRE', KEYS[5], ARGV[8])
  return {'BUSY'}
end
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  local g = redis.call('HMGET', KEYS[2], 'token', 'epoch', 'counter')
  if g[1] == ARGV[1] then return {'OK', g[2], g[3]} end
elseif current then
  if waiting then return wait_in_line(now()) end
  return {'BUSY'}
else
  -- Free: it goes to the head of the line, once waiters that stopped retrying are dropped.
  local ms = now()
  local dead = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ms - tonumber(ARGV[7]), 'LIMIT', 0, tonumber(ARGV[9]))
  for _, t in ipairs(dead) do
    redis.call('ZREM', KEYS[4], t)
    redis.call('ZREM', KEYS[5], t)
  end
  for _ = 1, tonumber(ARGV[9]) do
    local head = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
    if not head or head == ARGV[1] then break end
    if redis.call('ZSCORE', KEYS[5], head) then
      if waiting then return wait_in_line(ms) end
      return {'BUSY'}
    end
    redis.call('ZREM', KEYS[4], head)
  end
end
local id = identity()
if not id then return {'NOEPOCH', 'replica', ''} end
local st = redis.call('HMGET', KEYS[3], 'state', 'epoch', 'counter', 'id')
if not st[1] then return {'NOEPOCH', 'missing', ''} end
if st[1] ~= 'active' then
  if st[4] == id then return {'NOEPOCH', 'pending', st[2] or ''} end
  return {'NOEPOCH', 'server', st[2] or ''}
end
if st[4] ~= id then return {'NOEPOCH', 'server', st[2]} end
if tonumber(st[3]) >= tonumber(ARGV[5]) then return {'NOEPOCH', 'exhausted', st[2]} end
if current then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {'BUSY'}
end
redis.call('HINCRBY', KEYS[3], 'counter', 1)
local counter = redis.call('HGET', KEYS[3], 'counter')
local t = redis.call('TIME')
local at = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'token', ARGV[1], 'epoch', st[2], 'counter', counter, 'at', at)
if ARGV[4] == '1' then redis.call('HSET', KEYS[2], 'holder', ARGV[3]) end
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if waiting then
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('ZREM', KEYS[5], ARGV[1])
end
return {'OK', st[2], counter}
`;

// A waiter gave up. KEYS: lock, queue, seen. ARGV: token, channel, lock name.
// If it was the head and the lock is free, the next waiter is woken. Replies: LEFT | ABSENT.
const LEAVE = `
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 'ABSENT' end
if head == ARGV[1] and redis.call('EXISTS', KEYS[1]) == 0 then
  local next = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if next then redis.call('PUBLISH', ARGV[2], ARGV[3] .. string.char(0) .. next) end
end
return 'LEFT'
`;

// KEYS: lock, grant record. ARGV: token, ttl ms.
const EXTEND = `
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 'HELD'
end
return 'LOST'
`;

// KEYS: lock, grant record, queue, seen. ARGV: token, channel, lock name, stale ms.
// Publishes "<name>\0<token>" when a live waiter heads the queue (only it needs to wake), else "<name>" (wake all).
const RELEASE = `
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  local seen = head and redis.call('ZSCORE', KEYS[4], head)
  if seen then
    local t = redis.call('TIME')
    if tonumber(seen) >= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[4]) then
      redis.call('PUBLISH', ARGV[2], ARGV[3] .. string.char(0) .. head)
      return 'RELEASED'
    end
  end
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 'RELEASED'
end
return 'LOST'
`;

// KEYS: lock, grant record. Replies: {'FREE'} | {'HELD', epoch, counter, holder, has holder, at ms, pttl} | {'NORECORD'}.
const INSPECT = `
local token = redis.call('GET', KEYS[1])
if not token then return {'FREE'} end
local g = redis.call('HMGET', KEYS[2], 'token', 'epoch', 'counter', 'holder', 'at')
if g[1] ~= token then return {'NORECORD'} end
local pttl = redis.call('PTTL', KEYS[1])
return {'HELD', g[2], g[3], g[4] or '', g[4] and '1' or '0', g[5], tostring(pttl)}
`;

// Step 1 of a new epoch: a placeholder (state pending, epoch 0, the caller's
// nonce), only over a missing, foreign (another history, another palisade
// version) or used-up state. It keeps the epoch there as `floor`. While it
// lives, no other client can install or activate anything here.
// KEYS: fence state. ARGV: nonce, pending ttl ms, max counter.
// Replies: INSTALLED | ACTIVE (a healthy state is there) | WAIT (another client's placeholder) | REPLICA.
const INSTALL_EPOCH = `${IDENTITY}
local id = identity()
if not id then return 'REPLICA' end
local st = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'counter', 'id', 'nonce')
if st[4] == id then
  if st[1] == 'active' and tonumber(st[3]) < tonumber(ARGV[3]) then return 'ACTIVE' end
  if st[1] == 'pending' then
    if st[5] == ARGV[1] then return 'INSTALLED' end
    return 'WAIT'
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'pending', 'epoch', '0', 'counter', '0', 'id', id, 'nonce', ARGV[1], 'floor', st[2] or '0')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 'INSTALLED'
`;

// Step 3: the epoch taken (step 2) after the placeholder was in place becomes
// active, only if that very placeholder is still there on the same history.
// An epoch at or below the floor means epoch_seq went back (a restore): the
// state is left used up at the floor, so grants keep refusing (each attempt
// takes one more value) until the sequence passes the floor.
// KEYS: fence state. ARGV: nonce, epoch, max counter. Replies: ACTIVE | GONE | BEHIND.
const ACTIVATE_EPOCH = `${IDENTITY}
local id = identity()
local st = redis.call('HMGET', KEYS[1], 'state', 'id', 'nonce', 'floor')
if st[1] ~= 'pending' or st[3] ~= ARGV[1] or st[2] ~= id then return 'GONE' end
if tonumber(ARGV[2]) <= tonumber(st[4] or '0') then
  redis.call('HSET', KEYS[1], 'state', 'active', 'epoch', st[4], 'counter', ARGV[3])
  redis.call('HDEL', KEYS[1], 'nonce', 'floor')
  redis.call('PERSIST', KEYS[1])
  return 'BEHIND'
end
redis.call('HSET', KEYS[1], 'state', 'active', 'epoch', ARGV[2], 'counter', '0')
redis.call('HDEL', KEYS[1], 'nonce', 'floor')
redis.call('PERSIST', KEYS[1])
return 'ACTIVE'
`;

// Without a durable floor. KEYS: fence state. ARGV: observed epoch ('' = was missing), max counter, max epoch.
// Replies: ACTIVE | RETRY (the state changed meanwhile) | EXHAUSTED | REPLICA.
const BUMP_EPOCH = `${IDENTITY}
local id = identity()
if not id then return 'REPLICA' end
local st = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'counter', 'id')
local epoch
if ARGV[1] == '' then
  if st[1] then return 'RETRY' end
  epoch = 1
else
  if st[2] ~= ARGV[1] then return 'RETRY' end
  if st[1] == 'active' and st[4] == id and tonumber(st[3]) < tonumber(ARGV[2]) then return 'RETRY' end
  epoch = tonumber(st[2]) + 1
  if epoch > tonumber(ARGV[3]) then return 'EXHAUSTED' end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'active', 'epoch', string.format('%d', epoch), 'counter', '0', 'id', id)
return 'ACTIVE'
`;

const DEFINITIONS: Record<keyof Scripts, { lua: string; numberOfKeys: number; readOnly?: boolean }> = {
  palisadeGrantV3: { lua: GRANT, numberOfKeys: 5 },
  palisadeLeaveV1: { lua: LEAVE, numberOfKeys: 3 },
  palisadeExtendV1: { lua: EXTEND, numberOfKeys: 2 },
  palisadeReleaseV2: { lua: RELEASE, numberOfKeys: 4 },
  palisadeInspectV1: { lua: INSPECT, numberOfKeys: 2, readOnly: true },
  palisadeInstallEpochV2: { lua: INSTALL_EPOCH, numberOfKeys: 1 },
  palisadeActivateEpochV2: { lua: ACTIVATE_EPOCH, numberOfKeys: 1 },
  palisadeBumpEpochV2: { lua: BUMP_EPOCH, numberOfKeys: 1 },
};

/**
 * The Redis {@link LockBackend} behind `redisLockManager` (./redis-manager.ts), for callers
 * that compose their own manager (and for tests of the backend's contract).
 * Same options, guarantees and limits as `redisLockManager`.
 */
export function redisLockBackend(options: RedisLockManagerOptions): LockBackend {
  if (options === null || typeof options !== 'object') throw new InvalidArgumentError('options are required');
  const { client: redis, epochs } = options;
  if (!redis || typeof (redis as { defineCommand?: unknown }).defineCommand !== 'function') {
    throw new InvalidArgumentError('redis must be an ioredis client');
  }
  if (epochs !== undefined && (epochs === null || typeof epochs.execute !== 'function')) {
    throw new InvalidArgumentError('epochs must be a drizzle Postgres database');
  }
  const keys = redisKeyNames(options.namespace);
  const timeoutMs = options.commandTimeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS;
  if (!Number.isInteger(timeoutMs) || timeoutMs < 1 || timeoutMs > 600_000) {
    throw new InvalidArgumentError('commandTimeoutMs must be an integer in 1 … 600,000');
  }
  const allowFresh = options.allowFreshCounter === true;
  if (allowFresh && epochs) throw new InvalidArgumentError('allowFreshCounter only applies without epochs');
  // A pending epoch install that its client abandoned (crash, pause) expires after this.
  const pendingTtlMs = Math.min(10_000, Math.max(1_000, 2 * timeoutMs));
  // Grants wait at most this long for a new epoch to settle before giving up.
  const recoveryBudgetMs = Math.max(5_000, 3 * pendingTtlMs);

  for (const [name, definition] of Object.entries(DEFINITIONS)) redis.defineCommand(name, definition);
  const scripts = redis as unknown as Scripts;
  const notifier = releaseListener(redis, keys.channel);
  let sequenceChecked = false;

  function bounded<T>(what: string, run: () => Promise<T>): Promise<T> {
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new CommandTimeoutError(what, timeoutMs)), timeoutMs);
    });
    // run() starts inside the chain, so even a synchronous throw settles it and clears the timer.
    return Promise.race([Promise.resolve().then(run), timeout]).finally(() => clearTimeout(timer));
  }

  async function script(name: keyof Scripts, ...args: (string | number)[]): Promise<unknown> {
    return bounded(`Redis script ${name}`, () => scripts[name](...args));
  }

  async function postgres(what: string, query: ReturnType<typeof sql>): Promise<Record<string, unknown>[]> {
    if (!epochs) throw new FenceSourceError('no epochs database configured');
    return bounded(`Postgres ${what}`, () => execute(epochs, query));
  }

  async function checkSequence(): Promise<void> {
    if (sequenceChecked) return;
    const [row] = await postgres('epoch sequence check', fenceSequenceQuery('palisade', 'epoch_seq'));
    judgeFenceSequence(row, 'palisade.epoch_seq');
    sequenceChecked = true;
  }

  function fenceOf(epoch: unknown, counter: unknown): Fence {
    if (
      typeof epoch !== 'string' ||
      typeof counter !== 'string' ||
      !/^\d{1,20}$/.test(epoch) ||
      !/^\d{1,20}$/.test(counter)
    ) {
      throw new FenceSourceError(`Redis returned a malformed fence (${String(epoch)}, ${String(counter)})`);
    }
    const e = BigInt(epoch);
    const c = BigInt(counter);
    if (e < 1n || e > REDIS_MAX_EPOCH || c < 1n || c > REDIS_MAX_COUNTER) {
      throw new FenceSourceError(`Redis returned a fence out of range (epoch ${e}, counter ${c})`);
    }
    return toFence((e << BigInt(REDIS_COUNTER_BITS)) | c);
  }

  /**
   * Installs a new epoch from Postgres: a placeholder in Redis first, then
   * `nextval`, then activation if the placeholder is still ours on the same
   * history. The epoch is taken only once nobody else can install one here,
   * so it is above every epoch active here before; an epoch taken by a client
   * that then paused can no longer be activated (its placeholder expired or
   * was replaced). Nothing is compared with other namespaces' epochs, so many
   * namespaces recover at once without getting in each other's way. Returns
   * when the grant may be retried.
   */
  async function newEpochFromPostgres(): Promise<void> {
    await checkSequence();
    const nonce = randomBytes(16).toString('hex');
    const installed = await script(
      'palisadeInstallEpochV2',
      keys.fence,
      nonce,
      pendingTtlMs,
      REDIS_MAX_COUNTER.toString(),
    );
    if (installed === 'ACTIVE') return;
    if (installed === 'WAIT') return sleep(jitter(5, 30));
    if (installed === 'REPLICA') throw replicaError();
    if (installed !== 'INSTALLED') {
      throw new FenceSourceError(`unexpected reply to the epoch install: ${String(installed)}`);
    }
    const [next] = await postgres('nextval', sql`select nextval('palisade.epoch_seq') as epoch`);
    const epoch = int8(next?.epoch);
    if (epoch === null || epoch < 1n) throw new FenceSourceError('nextval of palisade.epoch_seq returned nothing');
    if (epoch > REDIS_MAX_EPOCH) {
      throw new FenceSourceError(`palisade.epoch_seq passed ${REDIS_MAX_EPOCH}: Redis fences have no epochs left`);
    }
    const activated = await script(
      'palisadeActivateEpochV2',
      keys.fence,
      nonce,
      epoch.toString(),
      REDIS_MAX_COUNTER.toString(),
    );
    recordFenceSource('redis', 'floor_check', activated === 'BEHIND' ? 'behind' : 'confirmed');
    if (activated === 'BEHIND') {
      throw new FenceSourceError(
        `palisade.epoch_seq (${epoch}) is at or below the epoch already in Redis for namespace ${JSON.stringify(options.namespace)}: the sequence went back (a restore?) or another database is in use; grants refuse until the sequence passes that epoch`,
      );
    }
    if (activated === 'ACTIVE') recordFenceSource('redis', 'new_epoch', 'postgres');
    // ACTIVE, or GONE (the placeholder expired or the history changed meanwhile): the grant retries either way.
  }

  function replicaError(): FenceSourceError {
    return new FenceSourceError(
      'the Redis server is not a primary (role is not master): a replica grants nothing, connect to the primary',
    );
  }

  async function newEpochInRedis(observed: string): Promise<void> {
    const bumped = await script(
      'palisadeBumpEpochV2',
      keys.fence,
      observed,
      REDIS_MAX_COUNTER.toString(),
      REDIS_MAX_EPOCH.toString(),
    );
    if (bumped === 'EXHAUSTED') throw new FenceSourceError('the Redis fence counter has no epochs left');
    if (bumped === 'REPLICA') throw replicaError();
    recordFenceSource('redis', 'new_epoch', 'redis');
  }

  async function recover(reason: string, observed: string): Promise<void> {
    recordFenceSource('redis', 'epoch_recovery', reason);
    if (reason === 'pending') return sleep(jitter(5, 30));
    if (reason === 'replica') throw replicaError();
    if (epochs) return newEpochFromPostgres();
    if (reason === 'exhausted') return newEpochInRedis(observed); // the state is intact: the next epoch is above it
    if (!allowFresh) {
      throw new FenceSourceError(
        reason === 'missing'
          ? `the Redis fence counter of namespace ${JSON.stringify(options.namespace)} is missing (flushed, evicted, restarted without persistence, or never used) and no epochs database is configured: refusing to start fences again`
          : `the Redis fence counter of namespace ${JSON.stringify(options.namespace)} was written on another data history (a restart, failover or failback) and no epochs database is configured: it may be behind fences already issued`,
      );
    }
    return newEpochInRedis(reason === 'missing' ? '' : observed);
  }

  async function grantOnce(
    name: string,
    token: string,
    ttlMs: number,
    holder: string | null,
    waiting: boolean,
  ): Promise<Grant | null> {
    const deadline = performance.now() + recoveryBudgetMs;
    for (let round = 0; round < MAX_GRANT_ROUNDS; round++) {
      const reply = (await script(
        'palisadeGrantV3',
        keys.lock(name),
        keys.grant(name),
        keys.fence,
        keys.queue(name),
        keys.seen(name),
        token,
        ttlMs,
        holder ?? '',
        holder === null ? '0' : '1',
        REDIS_MAX_COUNTER.toString(),
        waiting ? '1' : '0',
        REDIS_QUEUE_STALE_MS,
        QUEUE_TTL_MS,
        MAX_PRUNE,
      )) as Reply;
      if (reply[0] === 'OK') return { fence: fenceOf(reply[1], reply[2]) };
      if (reply[0] === 'BUSY') return null;
      if (reply[0] !== 'NOEPOCH') {
        throw new FenceSourceError(`unexpected reply to the grant script: ${JSON.stringify(reply)}`);
      }
      if (performance.now() >= deadline) break;
      await recover(String(reply[1]), String(reply[2] ?? ''));
    }
    throw new FenceSourceError('the Redis fence counter did not settle on a new epoch in time');
  }

  function releaseScript(name: string, token: string): Promise<unknown> {
    return script(
      'palisadeReleaseV2',
      keys.lock(name),
      keys.grant(name),
      keys.queue(name),
      keys.seen(name),
      token,
      keys.channel,
      name,
      REDIS_QUEUE_STALE_MS,
    );
  }

  return {
    kind: 'redis',

    async grant(name, token, ttlMs, holder, grantOptions) {
      try {
        return await grantOnce(name, token, ttlMs, holder, grantOptions?.waiting === true);
      } catch (err) {
        // The script may still have run (a timeout, a dropped connection): free what it may have taken.
        if (!(err instanceof FenceSourceError)) {
          releaseScript(name, token).catch(() => {});
        }
        throw err;
      }
    },

    async extend(name, token, ttlMs) {
      return (await script('palisadeExtendV1', keys.lock(name), keys.grant(name), token, ttlMs)) === 'HELD';
    },

    async release(name, token) {
      return (await releaseScript(name, token)) === 'RELEASED';
    },

    async inspect(name): Promise<LockInfo | null> {
      const reply = (await script('palisadeInspectV1', keys.lock(name), keys.grant(name))) as Reply;
      if (reply[0] === 'FREE') return null;
      if (reply[0] !== 'HELD') {
        throw new FenceSourceError(`lock ${JSON.stringify(name)} is held but its grant record is missing (evicted?)`);
      }
      const [, epoch, counter, holder, hasHolder, at, pttl] = reply;
      const remaining = Number(pttl);
      return {
        name,
        holder: hasHolder === '1' ? (holder ?? '') : null,
        fence: fenceOf(epoch, counter),
        acquiredAt: at && /^\d+$/.test(at) ? new Date(Number(at)) : null,
        remainingMs: Number.isFinite(remaining) && remaining >= 0 ? remaining : null,
      };
    },

    async leave(name, token) {
      await script('palisadeLeaveV1', keys.lock(name), keys.queue(name), keys.seen(name), token, keys.channel, name);
    },

    // A waiter with a token sleeps until a release names it as the head of the queue (or names nobody).
    waitForRelease: (name, ms, signal, token) =>
      notifier.wait(token === undefined ? name : `${name}\0${token}`, ms, signal),

    close: () => notifier.close(),
  };
}

/**
 * Wakes waiters when the release script publishes a lock name: one
 * subscriber connection per manager (a subscribed connection can run nothing
 * else), opened at the first wait. Never needed for correctness: every wait
 * also ends at its timeout.
 */
function releaseListener(redis: RedisClient, channel: string): ReleaseListener {
  return new ReleaseListener(async (onReleased, closing) => {
    // An offline queue here is harmless: nothing awaits it, disconnect() flushes it.
    const subscriber = redis.isCluster
      ? (redis as Cluster).duplicate([], { enableOfflineQueue: true }) // same startup nodes; PUBLISH reaches every node
      : (redis as Redis).duplicate({ enableOfflineQueue: true, autoResubscribe: false, lazyConnect: false });
    subscriber.on('error', () => {}); // reconnects by itself; waits fall back to their timeouts meanwhile
    if (!redis.isCluster) {
      // ioredis's own autoResubscribe sends SUBSCRIBE after a reconnect without handling its
      // rejection: a close() right then left an unhandled "Connection is closed." behind.
      let reconnecting = false;
      subscriber.on('close', () => {
        reconnecting = true;
      });
      subscriber.on('ready', () => {
        if (reconnecting) (subscriber as Redis).subscribe(channel).catch(() => {});
      });
    }
    subscriber.on('message', (from: string, message: string) => {
      if (from !== channel) return;
      const cut = message.indexOf('\0');
      if (cut < 0) {
        onReleased(message, `${message}\0`); // no live waiter in line: wake every waiter of the name
      } else {
        onReleased(message); // the head of the line (name\0token) …
        onReleased(message.slice(0, cut)); // … and waiters that gave no token
      }
    });
    // Closed while Redis is away: disconnect() rejects the queued SUBSCRIBE instead of leaving it pending.
    closing.addEventListener('abort', () => subscriber.disconnect(), { once: true });
    try {
      await subscriber.subscribe(channel);
    } catch (err) {
      subscriber.disconnect();
      throw err;
    }
    return async () => subscriber.disconnect();
  });
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function jitter(min: number, max: number): number {
  return min + Math.random() * (max - min);
}
