/**
 * The scripts that free a place — the lock (release) or a waiter's place in
 * line (leave) — and hand it over to, or wake, whoever's turn it is.
 *
 * Direct handoff: a release that finds a live waiter at the head of the
 * line grants the lock to it in the same script (its fence issued under the
 * grant script's checks) and publishes that, so the waiter's wake-up is its
 * grant — no retry round trip, no window for a barger. The waiter
 * confirms (`palisadeConfirm`, ./lease.ts) if it still holds the lock a
 * little later (src/fencing/lease.ts); until then the lock lives only
 * {@link REDIS_HANDOFF_CONFIRM_MS}. The
 * script also replies what it published, for a waiter in the releasing
 * process (../backend.ts).
 */
import { REDIS_MAX_COUNTER_ARG, type RedisKeyNames } from '../keys.js';
import { REDIS_QUEUE_STALE_MS } from './grant.js';
import { IDENTITY_LUA } from './identity.js';
import { RECORD_LUA } from './record.js';
import type { LuaScript, RunScript } from './script.js';

/**
 * A release hands the lock over only to a head of the line that retried
 * within this long (by the Redis server's clock): one likely to be alive
 * and listening.
 */
export const REDIS_HANDOFF_RECENT_MS = 500;
/**
 * A lock handed over by a release is held this long unless the waiter
 * confirms it (its grant or confirmation call sets its own TTL); a waiter
 * that died meanwhile delays the lock by at most this much.
 */
export const REDIS_HANDOFF_CONFIRM_MS = 2_000;

// KEYS: lock, queue, seen, fence state. ARGV: token, channel, lock name.
// A live waiter seen within the handoff window at the head of the line gets the lock here, with its
// fence, under the grant script's checks (current data history, active state, counter not used up),
// for the confirmation window only; published as "<name>\0<sha1(token)>\0<epoch>\0<counter>".
// Otherwise "<name>\0<sha1(token)>" wakes a live head (only it needs to wake), "<name>" wakes all.
// Replies: {'HANDED', sha1(token), epoch, counter, source (as the grant script's)} | 'RELEASED' | 'LOST'.
// The token itself is never published: a subscriber could release or extend with it.
const RELEASE_LUA = `${IDENTITY_LUA}${RECORD_LUA}
local current = redis.call('GET', KEYS[1])
if not current or token_of(current) ~= ARGV[1] then return 'LOST' end
redis.call('DEL', KEYS[1])
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
local seen = head and redis.call('ZSCORE', KEYS[3], head)
if not seen then
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 'RELEASED'
end
seen = tonumber(seen)
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nul = string.char(0)
if seen >= ms - ${REDIS_HANDOFF_RECENT_MS} then
  local id = identity()
  local st = id and redis.call('HMGET', KEYS[4], 'state', 'epoch', 'counter', 'id', 'source')
  if st and st[1] == 'active' and st[4] == id and tonumber(st[3]) < ${REDIS_MAX_COUNTER_ARG} then
    local counter = tostring(redis.call('HINCRBY', KEYS[4], 'counter', 1))
    local at = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
    redis.call('SET', KEYS[1], record(head, st[2], counter, at, '1', ''), 'PX', ${REDIS_HANDOFF_CONFIRM_MS})
    redis.call('ZREM', KEYS[2], head)
    redis.call('ZREM', KEYS[3], head)
    local hash = redis.sha1hex(head)
    local source = st[5] or ''
    redis.call('PUBLISH', ARGV[2], ARGV[3] .. nul .. hash .. nul .. st[2] .. nul .. counter .. nul .. source)
    return {'HANDED', hash, st[2], counter, source}
  end
end
if seen >= ms - ${REDIS_QUEUE_STALE_MS} then
  redis.call('PUBLISH', ARGV[2], ARGV[3] .. nul .. redis.sha1hex(head))
else
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return 'RELEASED'
`;

// A waiter gave up. KEYS: lock, queue, seen. ARGV: token, channel, lock name.
// A lock handed over to it and not yet confirmed is given back. If it was the head (or gave a lock
// back) and the lock is free, the next waiter is woken. Replies: LEFT | ABSENT.
const LEAVE_LUA = `${RECORD_LUA}
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
redis.call('ZREM', KEYS[3], ARGV[1])
local queued = redis.call('ZREM', KEYS[2], ARGV[1]) == 1
local freed = false
local current = redis.call('GET', KEYS[1])
if current and token_of(current) == ARGV[1] and select(5, record_of(current)) == '1' then
  redis.call('DEL', KEYS[1])
  freed = true
end
if not queued and not freed then return 'ABSENT' end
if (head == ARGV[1] or freed) and redis.call('EXISTS', KEYS[1]) == 0 then
  local next = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if next then
    redis.call('PUBLISH', ARGV[2], ARGV[3] .. string.char(0) .. redis.sha1hex(next))
  elseif freed then
    redis.call('PUBLISH', ARGV[2], ARGV[3])
  end
end
return 'LEFT'
`;

/** @internal */
export const RELEASE_SCRIPT: LuaScript = { name: 'palisadeReleaseV8', lua: RELEASE_LUA, numberOfKeys: 4 };
/** @internal */
export const LEAVE_SCRIPT: LuaScript = { name: 'palisadeLeaveV3', lua: LEAVE_LUA, numberOfKeys: 3 };

/**
 * @internal What a release did: nothing (`token` did not hold the lock),
 * freed it, or handed it over to the waiter whose token hashes to `hash`
 * (what it published to that waiter, for a waiter in this process).
 */
export type ReleaseReply =
  | { readonly released: false }
  | { readonly released: true; readonly handed?: { hash: string; epoch: string; counter: string; source: string } };

const NOT_RELEASED: ReleaseReply = { released: false };
const RELEASED: ReleaseReply = { released: true };

/** @internal Frees the lock if `token` holds it, handing it over to a live head of the line. */
export async function runRelease(
  run: RunScript,
  keys: RedisKeyNames,
  name: string,
  token: string,
): Promise<ReleaseReply> {
  const reply = await run(RELEASE_SCRIPT, [
    keys.lock(name),
    keys.queue(name),
    keys.seen(name),
    keys.fence,
    token,
    keys.channel,
    name,
  ]);
  if (reply === 'RELEASED') return RELEASED;
  if (Array.isArray(reply) && reply[0] === 'HANDED') {
    const [, hash, epoch, counter, source = ''] = reply as unknown[];
    return {
      released: true,
      handed: { hash: String(hash), epoch: String(epoch), counter: String(counter), source: String(source) },
    };
  }
  return NOT_RELEASED;
}

/** @internal Drops `token` from the lock's queue. */
export async function runLeave(run: RunScript, keys: RedisKeyNames, name: string, token: string): Promise<void> {
  await run(LEAVE_SCRIPT, [keys.lock(name), keys.queue(name), keys.seen(name), token, keys.channel, name]);
}
