/**
 * The Redis lock backend: the lock key (token and grant record, with its
 * TTL) and the fence counter in one Lua script (./scripts/grant.ts), on one
 * ioredis client, with fences that never go down even when Redis forgets
 * its counter (./epochs.ts). The keys are listed in ./keys.ts; the README
 * (Lock managers → Redis, and what each guarantees) is the manual.
 */
import { createHash } from 'node:crypto';
import { performance } from 'node:perf_hooks';
import { FenceSourceError, InvalidArgumentError } from '../../../errors.js';
import type { Grant, GrantOptions, LockBackend } from '../../backend.js';
import type { Fence } from '../../fence.js';
import { checkTtl } from '../../options.js';
import { commandDeadline } from './command-deadline.js';
import { epochRecovery } from './epochs.js';
import { fenceOf, redisKeyNames } from './keys.js';
import { checkRedisOptions, type RedisLockManagerOptions } from './options.js';
import { type HandedOver, releaseSubscriber } from './release-subscriber.js';
import { ACTIVATE_EPOCH_SCRIPT, BUMP_EPOCH_SCRIPT, INSTALL_EPOCH_SCRIPT } from './scripts/epoch.js';
import { GRANT_SCRIPT, runGrant } from './scripts/grant.js';
import { CONFIRM_SCRIPT, EXTEND_SCRIPT, INSPECT_SCRIPT, runConfirm, runExtend, runInspect } from './scripts/lease.js';
import { LEAVE_SCRIPT, REDIS_HANDOFF_CONFIRM_MS, RELEASE_SCRIPT, runLeave, runRelease } from './scripts/release.js';
import { scriptRunner } from './scripts/script.js';
import { epochSource } from './source.js';

// Existing import paths (tests, tools) keep working.
export {
  REDIS_COUNTER_BITS,
  REDIS_MAX_COUNTER,
  REDIS_MAX_EPOCH,
  type RedisKeyNames,
  redisKeyNames,
  splitRedisFence,
} from './keys.js';
export type { RedisClient, RedisLockManagerOptions } from './options.js';
export { REDIS_QUEUE_STALE_MS } from './scripts/grant.js';
export { REDIS_HANDOFF_CONFIRM_MS, REDIS_HANDOFF_RECENT_MS } from './scripts/release.js';

// The recovery budget (below) is what bounds a grant's rounds; this only stops a server whose answers
// never change from spinning for all of it. 200 rounds used to end a wait for another client's
// install after ~4 s (sleeps of 5–30 ms), before its placeholder could expire (up to 10 s).
const MAX_GRANT_ROUNDS = 10_000;

const SCRIPTS = [
  GRANT_SCRIPT,
  LEAVE_SCRIPT,
  EXTEND_SCRIPT,
  CONFIRM_SCRIPT,
  RELEASE_SCRIPT,
  INSPECT_SCRIPT,
  INSTALL_EPOCH_SCRIPT,
  ACTIVATE_EPOCH_SCRIPT,
  BUMP_EPOCH_SCRIPT,
];

/**
 * The Redis {@link LockBackend} behind `redisLockManager` (./manager.ts), for callers
 * that compose their own manager (and for tests of the backend's contract).
 * Same options, guarantees and limits as `redisLockManager`.
 * @throws {InvalidArgumentError} for bad options.
 */
export function redisLockBackend(options: RedisLockManagerOptions): LockBackend {
  const checked = checkRedisOptions(options);
  const keys = redisKeyNames(checked.namespace);
  const bounded = commandDeadline(checked.timeoutMs);
  const run = scriptRunner(checked.client, SCRIPTS, bounded);
  const recover = epochRecovery(checked, keys, run, bounded);
  // With `epochs`, every grant names the source its epoch is filed under (an unfiled epoch is replaced).
  const filed = checked.epochs !== undefined;
  const notifier = releaseSubscriber(checked.client, keys.channel);
  // Grants wait at most this long for a new epoch to settle before giving up.
  const recoveryBudgetMs = Math.max(5_000, 3 * Math.min(10_000, Math.max(1_000, 2 * checked.timeoutMs)));

  async function releaseToken(name: string, token: string): Promise<boolean> {
    const reply = await runRelease(run, keys, name, token);
    // A waiter of this process gets its turn from the reply, before the published message arrives.
    if (reply.released && reply.handed) {
      const { hash, epoch, counter, source } = reply.handed;
      notifier.deliver(`${name}\0${hash}`, { epoch, counter, source } satisfies HandedOver);
    }
    return reply.released;
  }

  async function grantOnce(
    name: string,
    token: string,
    ttlMs: number,
    holder: string | null,
    waiting: boolean,
    recovering: GrantOptions['recovering'],
  ): Promise<Grant | null> {
    // The lock's value is the token, a NUL, then its grant record (./scripts/record.ts).
    if (token.includes('\0')) throw new InvalidArgumentError('a lock token must not contain NUL');
    // The script counts the fence before it sets the lock: a TTL Redis refuses would use one up.
    checkTtl(ttlMs);
    const deadline = performance.now() + recoveryBudgetMs;
    for (let round = 0; round < MAX_GRANT_ROUNDS; round++) {
      const reply = await runGrant(run, keys, name, token, ttlMs, holder, waiting, filed);
      if (reply.kind === 'granted') return grantOf(reply.fence, reply.source);
      if (reply.kind === 'busy') return null;
      if (reply.kind === 'source-unknown') {
        // Held by this token from an epoch whose id is not known (a re-sent grant after the state moved
        // on, or a lock handed over from an unfiled epoch): a lease would name a guessed source. Given
        // back (to the next in line, if one waits), then asked for again: a grant from now on names its
        // epoch's.
        await releaseToken(name, token);
        continue;
      }
      if (performance.now() >= deadline) break;
      // Redis answered: the new epoch is bounded by recoveryBudgetMs and the command timeouts, not by waitMs.
      const { reason, observed } = reply;
      await (recovering ? recovering(() => recover(reason, observed)) : recover(reason, observed));
    }
    throw new FenceSourceError('the Redis fence counter did not settle on a new epoch in time');
  }

  return {
    kind: 'redis',

    // A grant that failed may still have run (a timeout, a dropped connection): the lock manager
    // gives back what it may have taken, and never sends that token again.
    grant: (name, token, ttlMs, holder, grantOptions) =>
      grantOnce(name, token, ttlMs, holder, grantOptions?.waiting === true, grantOptions?.recovering),

    extend: (name, token, ttlMs) => runExtend(run, keys, name, token, ttlMs),

    release: releaseToken,

    inspect: (name) => runInspect(run, keys, name),

    leave: (name, token) => runLeave(run, keys, name, token),

    // A waiter with a token sleeps until a release names it (by the token's hash) as the head of the
    // queue, or names nobody.
    waitForRelease: (name, ms, signal, token) =>
      notifier.wait(token === undefined ? name : `${name}\0${tokenHash(token)}`, ms, signal),

    async waitForTurn(name, ms, signal, token) {
      const handed = (await notifier.waitForValue(`${name}\0${tokenHash(token)}`, ms, signal)) as
        | HandedOver
        | undefined;
      // Handed over from an epoch filed under no id: the next grant finds the lock its own, gives it back
      // and takes a fence of a filed epoch.
      if (!handed || (filed && handed.source === '')) return undefined;
      try {
        return grantOf(fenceOf(handed.epoch, handed.counter), handed.source, REDIS_HANDOFF_CONFIRM_MS);
      } catch {
        return undefined; // a malformed message: the next grant call finds out what it holds
      }
    },

    confirm: (name, token, ttlMs, holder, fence) => runConfirm(run, keys, name, token, ttlMs, holder, fence),

    close: () => notifier.close(),
  };
}

// A grant, with the source its epoch is filed under where Redis names one (./source.ts). Built field by
// field: spreading an object takes a slow clone path in V8, on every acquire.
function grantOf(fence: Fence, epochId: string, confirmWithinMs?: number): Grant {
  const source = epochSource(epochId);
  const grant: { fence: Fence; source?: string; confirmWithinMs?: number } = { fence };
  if (source !== undefined) grant.source = source;
  if (confirmWithinMs !== undefined) grant.confirmWithinMs = confirmWithinMs;
  return grant;
}

/** What the release script publishes instead of a token (`redis.sha1hex`): a subscriber learns nothing it could use. */
function tokenHash(token: string): string {
  return createHash('sha1').update(token).digest('hex');
}
