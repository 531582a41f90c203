/**
 * The scripts of the epoch protocol (../epochs.ts): install a placeholder,
 * activate an epoch from Postgres, or bump the epoch without a durable floor.
 */
import { REDIS_MAX_COUNTER_ARG, REDIS_MAX_EPOCH, type RedisKeyNames } from '../keys.js';
import { IDENTITY_LUA, MIN_VERSION_LUA, REDIS_MIN_VERSION } from './identity.js';
import type { LuaScript, RunScript } from './script.js';

// Step 1 of a new epoch: a placeholder (state pending, epoch 0, the caller's
// nonce), only over a missing, foreign (another history, another palisade
// version), used-up or unfiled state (an epoch filed under no database id:
// made in Redis alone, or by an earlier version; only clients with `epochs`
// install). It keeps the epoch there as `floor`. While it
// lives, no other client can install or activate anything here.
// KEYS: fence state. ARGV: nonce, pending ttl ms, max counter, minimum Redis version.
// Replies: INSTALLED | ACTIVE (a healthy state is there) | WAIT (another client's placeholder) | REPLICA
// | {'OLD', version} (a server too old for its history to be told apart; nothing written).
const INSTALL_EPOCH_LUA = `${IDENTITY_LUA}${MIN_VERSION_LUA}
local id = identity()
if not id then return 'REPLICA' end
local recent = recent_enough(ARGV[4])
if recent ~= true then return {'OLD', recent} end
local st = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'counter', 'id', 'nonce', 'source')
if st[4] == id then
  if st[1] == 'active' and tonumber(st[3]) < tonumber(ARGV[3]) and st[6] and st[6] ~= '' then return 'ACTIVE' end
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
// The epoch is filed under the id of the database it was taken from (ARGV[4]): the fence source of
// every grant from it (../source.ts), whatever database the granting client reads.
// KEYS: fence state. ARGV: nonce, epoch, max counter, source id. Replies: ACTIVE | GONE | BEHIND.
const ACTIVATE_EPOCH_LUA = `${IDENTITY_LUA}
local id = identity()
local st = redis.call('HMGET', KEYS[1], 'state', 'id', 'nonce', 'floor')
if st[1] ~= 'pending' or st[3] ~= ARGV[1] or st[2] ~= id then return 'GONE' end
if tonumber(ARGV[2]) <= tonumber(st[4] or '0') then
  -- The floor's id went with the state it was taken from: a re-sent grant of that epoch is told '?'.
  redis.call('HSET', KEYS[1], 'state', 'active', 'epoch', st[4], 'counter', ARGV[3], 'source', '?')
  redis.call('HDEL', KEYS[1], 'nonce', 'floor')
  redis.call('PERSIST', KEYS[1])
  return 'BEHIND'
end
redis.call('HSET', KEYS[1], 'state', 'active', 'epoch', ARGV[2], 'counter', '0', 'source', ARGV[4])
redis.call('HDEL', KEYS[1], 'nonce', 'floor')
redis.call('PERSIST', KEYS[1])
return 'ACTIVE'
`;

// Without a durable floor. KEYS: fence state. ARGV: observed epoch ('' = was missing), max counter, max epoch,
// minimum Redis version. Replies: ACTIVE | RETRY (the state changed meanwhile) | EXHAUSTED | REPLICA | {'OLD', version}.
const BUMP_EPOCH_LUA = `${IDENTITY_LUA}${MIN_VERSION_LUA}
local id = identity()
if not id then return 'REPLICA' end
local recent = recent_enough(ARGV[4])
if recent ~= true then return {'OLD', recent} end
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

/** @internal */
export const INSTALL_EPOCH_SCRIPT: LuaScript = {
  name: 'palisadeInstallEpochV4',
  lua: INSTALL_EPOCH_LUA,
  numberOfKeys: 1,
};
/** @internal */
export const ACTIVATE_EPOCH_SCRIPT: LuaScript = {
  name: 'palisadeActivateEpochV4',
  lua: ACTIVATE_EPOCH_LUA,
  numberOfKeys: 1,
};
/** @internal */
export const BUMP_EPOCH_SCRIPT: LuaScript = { name: 'palisadeBumpEpochV3', lua: BUMP_EPOCH_LUA, numberOfKeys: 1 };

/**
 * @internal Step 1: the reply, one of INSTALLED, ACTIVE, WAIT, REPLICA, or
 * `['OLD', version]` for a server older than `minVersion` (anything else is
 * unexpected).
 */
export async function runInstallEpoch(
  run: RunScript,
  keys: RedisKeyNames,
  nonce: string,
  pendingTtlMs: number,
  minVersion = REDIS_MIN_VERSION,
): Promise<unknown> {
  return run(INSTALL_EPOCH_SCRIPT, [keys.fence, nonce, pendingTtlMs, REDIS_MAX_COUNTER_ARG, minVersion]);
}

/** @internal Step 3: the reply, one of ACTIVE, GONE, BEHIND. */
export async function runActivateEpoch(
  run: RunScript,
  keys: RedisKeyNames,
  nonce: string,
  epoch: bigint,
  source: string,
): Promise<unknown> {
  return run(ACTIVATE_EPOCH_SCRIPT, [keys.fence, nonce, epoch.toString(), REDIS_MAX_COUNTER_ARG, source]);
}

/** @internal Without a floor: the reply, one of ACTIVE, RETRY, EXHAUSTED, REPLICA, `['OLD', version]`. */
export async function runBumpEpoch(
  run: RunScript,
  keys: RedisKeyNames,
  observed: string,
  minVersion = REDIS_MIN_VERSION,
): Promise<unknown> {
  return run(BUMP_EPOCH_SCRIPT, [keys.fence, observed, REDIS_MAX_COUNTER_ARG, REDIS_MAX_EPOCH.toString(), minVersion]);
}
