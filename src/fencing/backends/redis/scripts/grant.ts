/**
 * The grant script: the lock (its key set to the token and the grant record,
 * with the TTL) and the fence counter increment in one step, in the fair order of the lock's queue.
 *
 * A waiting `acquire` keeps one token for the whole wait. When its grant
 * finds the lock held — or free but promised to an earlier waiter — the
 * script puts the token at the end of the lock's queue (or, if it is
 * already there, only notes that it is still alive) and answers BUSY. A
 * release wakes only the head of the line (the other waiters retry at their
 * retry interval, every 100–200 ms with redisLockManager, which keeps their places). A free
 * lock goes only to the head of the queue; `tryAcquire` gets it only when
 * nobody waits. So among the waiters of one lock name, grants follow the
 * order in which they first found the lock taken, and a releaser that
 * acquires again goes to the back instead of barging in.
 *
 * A release that finds a live waiter at the head of the line hands the
 * lock over to it (./release.ts); the waiter's next grant call — or its
 * confirmation — makes the grant its own, with its TTL and holder label.
 *
 * A waiter that stops retrying (killed, paused, cut off) for longer than
 * {@link REDIS_QUEUE_STALE_MS} loses its place: the next grant drops it, so
 * it delays the lock by at most about that long; if it comes back it queues
 * again at the end. A waiter that gives up (timeout, abort) leaves the queue
 * at once (best effort). The queue keys expire a few seconds after their
 * last write, so nothing stays behind.
 *
 * The script issues a fence only from an active fence state of the current
 * data history whose counter is not used up; otherwise it answers NOEPOCH
 * and the client takes a new epoch (../epochs.ts).
 */
import { FenceSourceError } from '../../../../errors.js';
import type { Fence } from '../../../fence.js';
import { fenceOf, REDIS_MAX_COUNTER_ARG, type RedisKeyNames } from '../keys.js';
import { IDENTITY_LUA } from './identity.js';
import { RECORD_LUA } from './record.js';
import type { LuaScript, RunScript } from './script.js';

/**
 * A queued waiter that has not retried for this long (by the Redis server's
 * clock) loses its place in the lock's queue. Waiting acquires retry at
 * least every 250 ms (redisLockManager: every 100–200 ms) and at every release.
 */
export const REDIS_QUEUE_STALE_MS = 1_000;
/** The queue keys expire this long after their last write. */
export const QUEUE_TTL_MS = REDIS_QUEUE_STALE_MS + 4_000;
/** At most this many dead entries are dropped from a queue per grant (the rest at the next ones). */
const MAX_PRUNE = 64;

// KEYS: lock, fence state, queue, seen.
// ARGV: token, ttl ms, holder ('' for none, else '=' followed by the label), waiting ('1'/'0'), filed ('1'
// for a client with `epochs`, whose leases name their epoch's source; '0').
// Replies: {'OK', epoch, counter, source} | {'BUSY'} | {'NOEPOCH', reason, observed epoch}; `source` is the
// id of the database the fence's epoch was taken from ('' for an epoch from Redis alone or one activated by
// a client older than that field, to a client without `epochs` only; '?' for a re-sent grant whose epoch's
// id is not known: the state no longer holds that epoch, or, to a filed client, filed it under no id).
// The lock's value is the token and its grant record (./record.ts).
// The queue: KEYS[3] token → place (order of arrival), KEYS[4] token → last retry (Redis TIME, ms).
// The constants are part of the script (every argument is parsed on every call).
const GRANT_LUA = `${IDENTITY_LUA}${RECORD_LUA}
local waiting = ARGV[4] == '1'
local t
local function now()
  t = t or redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function wait_in_line(ms)
  if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
    local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
    local place = 1
    if last[2] then place = tonumber(last[2]) + 1 end
    redis.call('ZADD', KEYS[3], place, ARGV[1])
  end
  redis.call('ZADD', KEYS[4], ms, ARGV[1])
  redis.call('PEXPIRE', KEYS[3], ${QUEUE_TTL_MS})
  redis.call('PEXPIRE', KEYS[4], ${QUEUE_TTL_MS})
  return {'BUSY'}
end
-- Whether this token is in the line: only then does a grant take it out (the common, uncontended
-- grant finds no line and spends no call on it).
local queued = false
local current = redis.call('GET', KEYS[1])
if current and token_of(current) == ARGV[1] then
  local token, epoch, counter, at, handoff, holder = record_of(current)
  if token then
    -- A replica's copy of the lock is no grant (it may lag the primary's), nor is it confirmed there.
    if not identity() then return {'NOEPOCH', 'replica', ''} end
    if handoff == '1' then
      -- Handed over by a release (only for its confirmation window): this grant confirms it.
      if ARGV[3] ~= '' then holder = ARGV[3] end
      redis.call('SET', KEYS[1], record(token, epoch, counter, at, '', holder), 'PX', ARGV[2])
    end
    -- The id this grant's epoch is filed under, while the state still holds that epoch; once it moved on
    -- (a new epoch, or none) nothing here knows it: '?', and the client gives the lock back.
    local s = redis.call('HMGET', KEYS[2], 'epoch', 'source')
    local source = '?'
    if s[1] == epoch then source = s[2] or '' end
    if source == '' and ARGV[5] == '1' then source = '?' end
    return {'OK', epoch, counter, source}
  end
elseif current then
  if waiting then return wait_in_line(now()) end
  return {'BUSY'}
elseif redis.call('ZRANGE', KEYS[3], 0, 0)[1] then
  -- Free, with a line: it goes to the head of the line, once waiters that stopped retrying are dropped.
  local ms = now()
  local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ms - ${REDIS_QUEUE_STALE_MS}, 'LIMIT', 0, ${MAX_PRUNE})
  for _, d in ipairs(dead) do
    redis.call('ZREM', KEYS[3], d)
    redis.call('ZREM', KEYS[4], d)
  end
  -- Heads whose waiter left no retry at all go too, at most MAX_PRUNE of them per grant.
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  for _ = 1, ${MAX_PRUNE} do
    if not head or head == ARGV[1] or redis.call('ZSCORE', KEYS[4], head) then break end
    redis.call('ZREM', KEYS[3], head)
    head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  end
  -- Someone else first: a live waiter, or more dead places than one grant drops (the next ones drop them).
  if head and head ~= ARGV[1] then
    if waiting then return wait_in_line(ms) end
    return {'BUSY'}
  end
  queued = head ~= nil
end
local id = identity()
if not id then return {'NOEPOCH', 'replica', ''} end
local st = redis.call('HMGET', KEYS[2], 'state', 'epoch', 'counter', 'id', 'source')
if not st[1] then return {'NOEPOCH', 'missing', ''} end
if st[1] ~= 'active' then
  if st[4] == id then return {'NOEPOCH', 'pending', st[2] or ''} end
  return {'NOEPOCH', 'server', st[2] or ''}
end
if st[4] ~= id then return {'NOEPOCH', 'server', st[2]} end
if tonumber(st[3]) >= ${REDIS_MAX_COUNTER_ARG} then return {'NOEPOCH', 'exhausted', st[2]} end
-- A filed client takes no fence from an epoch filed under no id (made in Redis alone, or by an earlier
-- version): each manager would name it after the id it knows, two registers for one counter. It takes a
-- new epoch from its database instead (the install replaces such a state).
if ARGV[5] == '1' and (not st[5] or st[5] == '') then return {'NOEPOCH', 'unfiled', st[2]} end
-- HINCRBY's reply is a Lua number, exact (a counter stays below 2^39) and printed in full by tostring (%.14g).
-- The lock is free or this token's (checked above, in this same script): a plain SET takes it.
local counter = tostring(redis.call('HINCRBY', KEYS[2], 'counter', 1))
now()
local at = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
redis.call('SET', KEYS[1], record(ARGV[1], st[2], counter, at, '', ARGV[3]), 'PX', ARGV[2])
if queued then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
end
return {'OK', st[2], counter, st[5] or ''}
`;

/** @internal */
export const GRANT_SCRIPT: LuaScript = { name: 'palisadeGrantV10', lua: GRANT_LUA, numberOfKeys: 4 };

/**
 * @internal What a grant attempt found: the lock with its fence, taken (or
 * promised to an earlier waiter), the lock this token already held from an
 * epoch whose id is not known, or a fence state that needs a new epoch
 * (`reason`: missing, server, pending, exhausted, replica, unfiled; `observed`:
 * the epoch seen, '' if none).
 */
export type GrantReply =
  | { readonly kind: 'granted'; readonly fence: Fence; readonly source: string }
  | { readonly kind: 'source-unknown' }
  | { readonly kind: 'busy' }
  | { readonly kind: 'no-epoch'; readonly reason: string; readonly observed: string };

const BUSY: GrantReply = { kind: 'busy' };
const SOURCE_UNKNOWN: GrantReply = { kind: 'source-unknown' };

/** @internal A holder label as the grant and confirm scripts take it: '' for none, '=' before a label (which may be ''). */
export const holderArg = (holder: string | null): string => (holder === null ? '' : `=${holder}`);

/** @internal One run of the grant script. */
export async function runGrant(
  run: RunScript,
  keys: RedisKeyNames,
  name: string,
  token: string,
  ttlMs: number,
  holder: string | null,
  waiting: boolean,
  filed: boolean,
): Promise<GrantReply> {
  const reply = (await run(GRANT_SCRIPT, [
    keys.lock(name),
    keys.fence,
    keys.queue(name),
    keys.seen(name),
    token,
    ttlMs,
    holderArg(holder),
    waiting ? '1' : '0',
    filed ? '1' : '0',
  ])) as string[];
  if (reply[0] === 'OK') {
    if (reply[3] === '?') return SOURCE_UNKNOWN;
    return { kind: 'granted', fence: fenceOf(reply[1], reply[2]), source: String(reply[3] ?? '') };
  }
  if (reply[0] === 'BUSY') return BUSY;
  if (reply[0] !== 'NOEPOCH') {
    throw new FenceSourceError(`unexpected reply to the grant script: ${JSON.stringify(reply)}`);
  }
  return { kind: 'no-epoch', reason: String(reply[1]), observed: String(reply[2] ?? '') };
}
