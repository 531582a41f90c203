/**
 * The scripts that free a place — the lock (release) or a waiter's place in
 * line (leave) — and wake whoever's turn it is.
 */
import type { RedisKeyNames } from '../keys.js';
import { REDIS_QUEUE_STALE_MS } from './grant.js';
import type { LuaScript, RunScript } from './script.js';

// KEYS: lock, grant record, queue, seen. ARGV: token, channel, lock name, stale ms.
// Publishes "<name>\0<token>" when a live waiter heads the queue (only it needs to wake), else "<name>" (wake all).
const RELEASE_LUA = `
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

// A waiter gave up. KEYS: lock, queue, seen. ARGV: token, channel, lock name.
// If it was the head and the lock is free, the next waiter is woken. Replies: LEFT | ABSENT.
const LEAVE_LUA = `
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 'ABSENT' end
if head == ARGV[1] and redis.call('EXISTS', KEYS[1]) == 0 then
  local next = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if next then redis.call('PUBLISH', ARGV[2], ARGV[3] .. string.char(0) .. next) end
end
return 'LEFT'
`;

/** @internal */
export const RELEASE_SCRIPT: LuaScript = { name: 'palisadeReleaseV2', lua: RELEASE_LUA, numberOfKeys: 4 };
/** @internal */
export const LEAVE_SCRIPT: LuaScript = { name: 'palisadeLeaveV1', lua: LEAVE_LUA, numberOfKeys: 3 };

/** @internal Frees the lock if `token` holds it; true if it did. */
export async function runRelease(run: RunScript, keys: RedisKeyNames, name: string, token: string): Promise<boolean> {
  const reply = await run(RELEASE_SCRIPT, [
    keys.lock(name),
    keys.grant(name),
    keys.queue(name),
    keys.seen(name),
    token,
    keys.channel,
    name,
    REDIS_QUEUE_STALE_MS,
  ]);
  return reply === 'RELEASED';
}

/** @internal Drops `token` from the lock's queue. */
export async function runLeave(run: RunScript, keys: RedisKeyNames, name: string, token: string): Promise<void> {
  await run(LEAVE_SCRIPT, [keys.lock(name), keys.queue(name), keys.seen(name), token, keys.channel, name]);
}
