/** The scripts that read or renew a held lock without changing its owner: confirm, extend and inspect. */
import { FenceSourceError } from '../../../../errors.js';
import type { LockInfo } from '../../../backend.js';
import type { Fence } from '../../../fence.js';
import { fenceOf, type RedisKeyNames } from '../keys.js';
import { holderArg } from './grant.js';
import type { LuaScript, RunScript } from './script.js';

// KEYS: lock, grant record. ARGV: token, ttl ms.
const EXTEND_LUA = `
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 'HELD'
end
return 'LOST'
`;

// KEYS: lock, grant record. Replies: {'FREE'} | {'HELD', epoch, counter, holder, has holder, at ms, pttl} | {'NORECORD'}.
const INSPECT_LUA = `
local token = redis.call('GET', KEYS[1])
if not token then return {'FREE'} end
local g = redis.call('HMGET', KEYS[2], 'token', 'epoch', 'counter', 'holder', 'at')
if g[1] ~= token then return {'NORECORD'} end
local pttl = redis.call('PTTL', KEYS[1])
return {'HELD', g[2], g[3], g[4] or '', g[4] and '1' or '0', g[5], tostring(pttl)}
`;

// A lock handed over by a release becomes the waiter's own: its TTL and holder label. The TTL only
// lengthens: the lease may have extended itself further before it confirmed (a shorter TTL here would
// end the lock before the lease's own estimate, which keeps the longer one).
// KEYS: lock, grant record. ARGV: token, ttl ms, holder ('' for none, else '=' and the label).
// Replies: {'OK', epoch, counter} | {'LOST'}.
const CONFIRM_LUA = `
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'LOST'} end
local g = redis.call('HMGET', KEYS[2], 'token', 'epoch', 'counter')
if g[1] ~= ARGV[1] then return {'LOST'} end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
redis.call('HDEL', KEYS[2], 'handoff')
if ARGV[3] ~= '' then redis.call('HSET', KEYS[2], 'holder', string.sub(ARGV[3], 2)) end
return {'OK', g[2], g[3]}
`;

/** @internal */
export const CONFIRM_SCRIPT: LuaScript = { name: 'palisadeConfirmV3', lua: CONFIRM_LUA, numberOfKeys: 2 };
/** @internal */
export const EXTEND_SCRIPT: LuaScript = { name: 'palisadeExtendV1', lua: EXTEND_LUA, numberOfKeys: 2 };
/** @internal */
export const INSPECT_SCRIPT: LuaScript = { name: 'palisadeInspectV1', lua: INSPECT_LUA, numberOfKeys: 2 };

/** @internal Resets the TTL if `token` holds the lock; false if it does not. */
export async function runExtend(
  run: RunScript,
  keys: RedisKeyNames,
  name: string,
  token: string,
  ttlMs: number,
): Promise<boolean> {
  return (await run(EXTEND_SCRIPT, [keys.lock(name), keys.grant(name), token, ttlMs])) === 'HELD';
}

/**
 * @internal Makes a lock handed over to `token` its own (TTL, holder); true
 * if `token` still held it with `fence`.
 */
export async function runConfirm(
  run: RunScript,
  keys: RedisKeyNames,
  name: string,
  token: string,
  ttlMs: number,
  holder: string | null,
  fence: Fence,
): Promise<boolean> {
  const reply = (await run(CONFIRM_SCRIPT, [
    keys.lock(name),
    keys.grant(name),
    token,
    ttlMs,
    holderArg(holder),
  ])) as string[];
  return reply[0] === 'OK' && fenceOf(reply[1], reply[2]) === fence;
}

/**
 * @internal Who holds the lock, or null if it is free.
 * @throws {FenceSourceError} when the lock is held but its grant record is gone.
 */
export async function runInspect(run: RunScript, keys: RedisKeyNames, name: string): Promise<LockInfo | null> {
  const reply = (await run(INSPECT_SCRIPT, [keys.lock(name), keys.grant(name)])) as string[];
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
}
