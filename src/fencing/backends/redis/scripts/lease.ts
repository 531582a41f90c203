/** The scripts that read or renew a held lock without changing its owner: confirm, extend and inspect. */
import { FenceSourceError } from '../../../../errors.js';
import type { LockInfo } from '../../../backend.js';
import type { Fence } from '../../../fence.js';
import { fenceOf, type RedisKeyNames } from '../keys.js';
import { holderArg } from './grant.js';
import { RECORD_LUA } from './record.js';
import type { LuaScript, RunScript } from './script.js';

// KEYS: lock. ARGV: token, ttl ms.
const EXTEND_LUA = `${RECORD_LUA}
local current = redis.call('GET', KEYS[1])
if current and token_of(current) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 'HELD'
end
return 'LOST'
`;

// KEYS: lock. Replies: {'FREE'} | {'HELD', epoch, counter, holder, has holder, at ms, pttl} | {'NORECORD'}.
const INSPECT_LUA = `${RECORD_LUA}
local current = redis.call('GET', KEYS[1])
if not current then return {'FREE'} end
local token, epoch, counter, at, _, holder = record_of(current)
if not token then return {'NORECORD'} end
local pttl = redis.call('PTTL', KEYS[1])
return {'HELD', epoch, counter, string.sub(holder, 2), holder ~= '' and '1' or '0', at, tostring(pttl)}
`;

// A lock handed over by a release becomes the waiter's own: its TTL and holder label. The TTL only
// lengthens: the lease may have extended itself further before it confirmed (a shorter TTL here would
// end the lock before the lease's own estimate, which keeps the longer one).
// KEYS: lock. ARGV: token, ttl ms, holder ('' for none, else '=' and the label).
// Replies: {'OK', epoch, counter} | {'LOST'}.
const CONFIRM_LUA = `${RECORD_LUA}
local current = redis.call('GET', KEYS[1])
if not current or token_of(current) ~= ARGV[1] then return {'LOST'} end
local token, epoch, counter, at, _, holder = record_of(current)
if not token then return {'LOST'} end
if ARGV[3] ~= '' then holder = ARGV[3] end
local confirmed = record(token, epoch, counter, at, '', holder)
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[1], confirmed, 'PX', ARGV[2])
else
  redis.call('SET', KEYS[1], confirmed, 'KEEPTTL')
end
return {'OK', epoch, counter}
`;

/** @internal */
export const CONFIRM_SCRIPT: LuaScript = { name: 'palisadeConfirmV4', lua: CONFIRM_LUA, numberOfKeys: 1 };
/** @internal */
export const EXTEND_SCRIPT: LuaScript = { name: 'palisadeExtendV2', lua: EXTEND_LUA, numberOfKeys: 1 };
/** @internal */
export const INSPECT_SCRIPT: LuaScript = { name: 'palisadeInspectV2', lua: INSPECT_LUA, numberOfKeys: 1 };

/** @internal Resets the TTL if `token` holds the lock; false if it does not. */
export async function runExtend(
  run: RunScript,
  keys: RedisKeyNames,
  name: string,
  token: string,
  ttlMs: number,
): Promise<boolean> {
  return (await run(EXTEND_SCRIPT, [keys.lock(name), token, ttlMs])) === 'HELD';
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
  const reply = (await run(CONFIRM_SCRIPT, [keys.lock(name), token, ttlMs, holderArg(holder)])) as string[];
  return reply[0] === 'OK' && fenceOf(reply[1], reply[2]) === fence;
}

/**
 * @internal Who holds the lock, or null if it is free.
 * @throws {FenceSourceError} when the lock's value is not one palisade wrote (an older
 * palisade's lock, or one set by hand).
 */
export async function runInspect(run: RunScript, keys: RedisKeyNames, name: string): Promise<LockInfo | null> {
  const reply = (await run(INSPECT_SCRIPT, [keys.lock(name)])) as string[];
  if (reply[0] === 'FREE') return null;
  if (reply[0] !== 'HELD') {
    throw new FenceSourceError(
      `lock ${JSON.stringify(name)} is held, but not as this palisade version records a grant (an older version's lock, or one set by hand)`,
    );
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
