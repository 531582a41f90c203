/**
 * The epoch protocol: how a Redis namespace whose fence state is missing,
 * foreign or used up gets a new epoch above every fence it issued before.
 *
 * The fence state records the data history it was written on (see
 * ./scripts/identity.ts for why `master_replid` names one); the grant
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
import { setTimeout as sleep } from 'node:timers/promises';
import { sql } from 'drizzle-orm';
import { execute, int8 } from '../../../driver.js';
import { FenceSourceError } from '../../../errors.js';
import { recordFenceSource } from '../../../telemetry/otel.js';
import { fenceSequenceQuery, judgeFenceSequence } from '../../sequence.js';
import { readingSourceId, sourceIdOf } from '../../source.js';
import type { Bounded } from './command-deadline.js';
import { REDIS_MAX_EPOCH, type RedisKeyNames } from './keys.js';
import type { CheckedRedisOptions } from './options.js';
import { runActivateEpoch, runBumpEpoch, runInstallEpoch } from './scripts/epoch.js';
import { REDIS_MIN_VERSION } from './scripts/identity.js';
import type { RunScript } from './scripts/script.js';

const nextEpochSql = () => sql`select nextval('palisade.epoch_seq') as epoch, palisade.fence_source_id() as source`;

/**
 * @internal Takes a new epoch after the grant script answered NOEPOCH for
 * `reason` having seen epoch `observed` (''); returns when the grant may be
 * retried.
 * @throws {FenceSourceError} when no safe epoch can be had (a replica, no
 * floor and no `allowFreshCounter`, the sequence behind Redis, epochs used up).
 */
export type RecoverEpoch = (reason: string, observed: string) => Promise<void>;

/** @internal The epoch recovery of one backend. */
export function epochRecovery(
  options: CheckedRedisOptions,
  keys: RedisKeyNames,
  run: RunScript,
  bounded: Bounded,
): RecoverEpoch {
  const { epochs, allowFresh, namespace, timeoutMs } = options;
  // A pending epoch install that its client abandoned (crash, pause) expires after this.
  const pendingTtlMs = Math.min(10_000, Math.max(1_000, 2 * timeoutMs));
  let sequenceChecked = false;

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

  /**
   * Installs a new epoch from Postgres: a placeholder in Redis first, then
   * `nextval`, then activation if the placeholder is still ours on the same
   * history. The epoch is taken only once nobody else can install one here,
   * so it is above every epoch active here before; an epoch taken by a client
   * that then paused can no longer be activated (its placeholder expired or
   * was replaced). Nothing is compared with other namespaces' epochs, so many
   * namespaces recover at once without getting in each other's way.
   */
  async function newEpochFromPostgres(): Promise<void> {
    await checkSequence();
    const nonce = randomBytes(16).toString('hex');
    const installed = await runInstallEpoch(run, keys, nonce, pendingTtlMs);
    if (installed === 'ACTIVE') return;
    if (installed === 'WAIT') return sleep(jitter(5, 30));
    if (installed === 'REPLICA') throw replicaError();
    if (isOld(installed)) throw oldServerError(installed[1]);
    if (installed !== 'INSTALLED') {
      throw new FenceSourceError(`unexpected reply to the epoch install: ${String(installed)}`);
    }
    // The database's id with the epoch, in one statement: the epoch's fences are filed under it.
    const [next] = await readingSourceId(postgres('nextval', nextEpochSql()));
    const epoch = int8(next?.epoch);
    if (epoch === null || epoch < 1n) throw new FenceSourceError('nextval of palisade.epoch_seq returned nothing');
    const source = sourceIdOf(next, 'source');
    if (epoch > REDIS_MAX_EPOCH) {
      throw new FenceSourceError(`palisade.epoch_seq passed ${REDIS_MAX_EPOCH}: Redis fences have no epochs left`);
    }
    const activated = await runActivateEpoch(run, keys, nonce, epoch, source);
    recordFenceSource('redis', 'floor_check', activated === 'BEHIND' ? 'behind' : 'confirmed');
    if (activated === 'BEHIND') {
      throw new FenceSourceError(
        `palisade.epoch_seq (${epoch}) is at or below the epoch already in Redis for namespace ${JSON.stringify(namespace)}: the sequence went back (a restore?) or another database is in use; grants refuse until the sequence passes that epoch`,
      );
    }
    if (activated === 'ACTIVE') recordFenceSource('redis', 'new_epoch', 'postgres');
    // ACTIVE, or GONE (the placeholder expired or the history changed meanwhile): the grant retries either way.
  }

  async function newEpochInRedis(observed: string): Promise<void> {
    const bumped = await runBumpEpoch(run, keys, observed);
    if (bumped === 'EXHAUSTED') throw new FenceSourceError('the Redis fence counter has no epochs left');
    if (bumped === 'REPLICA') throw replicaError();
    if (isOld(bumped)) throw oldServerError(bumped[1]);
    recordFenceSource('redis', 'new_epoch', 'redis');
  }

  return async function recover(reason, observed) {
    recordFenceSource('redis', 'epoch_recovery', reason);
    if (reason === 'pending') return sleep(jitter(5, 30));
    if (reason === 'replica') throw replicaError();
    if (epochs) return newEpochFromPostgres();
    if (reason === 'exhausted') return newEpochInRedis(observed); // the state is intact: the next epoch is above it
    if (!allowFresh) {
      throw new FenceSourceError(
        reason === 'missing'
          ? `the Redis fence counter of namespace ${JSON.stringify(namespace)} is missing (flushed, evicted, restarted without persistence, or never used) and no epochs database is configured: refusing to start fences again`
          : `the Redis fence counter of namespace ${JSON.stringify(namespace)} was written on another data history (a restart, failover or failback) and no epochs database is configured: it may be behind fences already issued`,
      );
    }
    return newEpochInRedis(reason === 'missing' ? '' : observed);
  };
}

function replicaError(): FenceSourceError {
  return new FenceSourceError(
    'the Redis server is not a primary (role is not master): a replica grants nothing, connect to the primary',
  );
}

const isOld = (reply: unknown): reply is ['OLD', unknown] => Array.isArray(reply) && reply[0] === 'OLD';

function oldServerError(version: unknown): FenceSourceError {
  return new FenceSourceError(
    `the Redis server is version ${String(version)}: palisade issues fences only on Redis ${REDIS_MIN_VERSION} or later, where a restart always changes the server's replication id (its data history)`,
  );
}

function jitter(min: number, max: number): number {
  return min + Math.random() * (max - min);
}
