/**
 * Fence source id changes while two lock managers grant one lock (README,
 * "Two scopes of fencing"), searched: random sequences of grants by either
 * manager, changes of `palisade.fence_sources`, losses of the Redis fence
 * state, and grants whose link to Postgres delivers the statement's Bind
 * and holds back its Execute (a lost segment) until a later step — for
 * Redis, the epoch statement of the grant that takes a new epoch. Checked
 * against what the README promises:
 *
 * - per lock, in fence order, a source once left behind is never named
 *   again (the checker's rule: one counter, one register per lock);
 * - a holder is refused on a row nobody wrote once a higher fence of its
 *   lock, named by the same source, was granted (the Postgres backends'
 *   grant claims) or, on Redis, wrote (its claim is lazy).
 *
 * Each run on a fresh database; 40 runs at the full count.
 */
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import { describe, expect } from 'vitest';
import type { Database } from '../../src/driver.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { redisKeyNames } from '../../src/fencing/backends/redis/backend.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { Lease } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { checkHistory, type HistoryEvent } from '../../src/testing/index.js';
import { resource, scenarioDatabase, scenarioRows, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { withholdingProxy } from '../support/withholding-proxy.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

type Step =
  | { readonly kind: 'grant'; readonly by: 'split' | 'direct' }
  | { readonly kind: 'change' | 'deliver' | 'flush' };

const grantArb = fc.record({ kind: fc.constant('grant' as const), by: fc.constantFrom('split', 'direct') });
// Steps of a run on `kind`: a loss of the fence state only where there is one (Redis).
const stepsArb = (kind: Kind): fc.Arbitrary<Step[]> =>
  fc.array(
    fc.oneof(
      { weight: 3, arbitrary: grantArb as fc.Arbitrary<Step> },
      { weight: 1, arbitrary: fc.constant({ kind: 'change' } as const) },
      { weight: 1, arbitrary: fc.constant({ kind: 'deliver' } as const) },
      ...(kind === 'redis' ? [{ weight: 1, arbitrary: fc.constant({ kind: 'flush' } as const) }] : []),
    ),
    { minLength: 1, maxLength: 10 },
  );

type Kind = 'postgres' | 'advisory' | 'redis';
const kinds: Kind[] = needs('REDIS_URL') ? ['postgres', 'advisory', 'redis'] : ['postgres', 'advisory'];

function managerOn(kind: Kind, client: postgres.Sql, namespace: string, redis: Redis): LockManager {
  const db = drizzle(client) as unknown as Database;
  if (kind === 'redis') return redisLockManager({ client: redis, namespace, epochs: db, commandTimeoutMs: 3_000 });
  return kind === 'advisory'
    ? advisoryLockManager({ client, namespace })
    : postgresLockManager({ client: db, namespace, listen: false });
}

// A holder that has not noticed it lost the lease: its signal never fired.
const unaware = (lease: Lease) => ({ fence: lease.fence, lock: lease.lock, signal: new AbortController().signal });

describe.runIf(needs('DATABASE_URL'))('fence source id changes, searched', () => {
  test.prop(
    [fc.constantFrom(...kinds).chain((kind) => fc.tuple(fc.constant(kind), stepsArb(kind)))],
    propertyParams({ numRuns: propertyRuns(40) }),
  )(
    "per lock the sources follow the fences, and a holder is refused once a higher fence of its lock's source was granted (Redis: wrote)",
    async ([kind, steps]) => {
      const scenario = await scenarioDatabase();
      const proxy = withholdingProxy(scenario.url as string);
      const viaProxy = postgres(await proxy.url(), { max: 2, onnotice: () => {} });
      const direct = postgres(scenario.url as string, { max: 2, onnotice: () => {} });
      const namespace = uniqueNamespace('src');
      const redis = new Redis(process.env.REDIS_URL ?? 'redis://127.0.0.1:6379', { lazyConnect: true });
      const split = managerOn(kind, viaProxy, namespace, redis);
      const other = managerOn(kind, direct, namespace, redis);
      const leases: Lease[] = [];
      const pending: Promise<void>[] = [];
      let held = false; // a split grant's Execute is held back
      // A lease is given back at once: the next grant need not wait, and its holder stays a stale one.
      const take = async (manager: LockManager) => {
        const lease = await manager.acquire('L', { ttlMs: 10_000, waitMs: 5_000, autoExtend: false });
        leases.push(lease);
        await lease.release();
      };
      try {
        // The one-time checks, and the grant statement prepared on each manager's session: Bind, Execute, Sync.
        for (const m of [split, other]) await (await m.acquire('warm', { ttlMs: 5_000 })).release();
        for (const step of steps) {
          if (step.kind === 'change') {
            await scenario.db.execute(sql`update palisade.fence_sources set source_id = 'pg:' || md5(random()::text)`);
          } else if (step.kind === 'flush') {
            await redis.del(redisKeyNames(namespace).fence);
          } else if (step.kind === 'deliver') {
            proxy.release();
            held = false;
          } else if (step.kind === 'grant' && step.by === 'direct') {
            await take(other);
          } else if (!held) {
            // Nothing of the split manager in flight (its last release included) before its next statement splits.
            await Promise.all(pending);
            const before = proxy.splits;
            proxy.state.splitAfterBind = true;
            pending.push(take(split));
            // Bound, and the server has bound it (its snapshot taken) before the next step.
            for (let i = 0; i < 200 && proxy.splits === before; i++) await sleep(5);
            await sleep(20);
            held = proxy.splits > before;
            if (!held) proxy.release(); // the statement went out whole: nothing held
          }
        }
        proxy.release();
        await Promise.all(pending);

        // The checker's rule on the history of these grants.
        const history: HistoryEvent[] = leases.map((l, i) => ({
          process: 'p',
          type: 'ok',
          op: 'acquire',
          lock: 'L',
          fence: l.fence.toString(),
          source: l.lock?.source ?? '',
          time: i,
        }));
        const anomalies = checkHistory({ history, audit: [], counters: {} }).anomalies.filter((a) =>
          a.includes('names source'),
        );
        expect(anomalies, `grants: ${leases.map((l) => `${l.fence}@${l.lock?.source}`).join(', ')}`).toEqual([]);

        // Every holder below the highest fence its source granted is refused on a row nobody wrote — on Redis
        // once that highest holder wrote (a claim at its first lock-scoped write).
        const repo = fencedRepository(scenario.db, resource, { scope: 'lock' });
        const { newRow } = scenarioRows(() => scenario);
        const write = async (lease: Lease) =>
          (await repo.with(unaware(lease)).update({ id: await newRow() }, { value: 'w' })).status;
        if (kind === 'redis') {
          const tops = new Map<string | undefined, Lease>();
          for (const l of leases) {
            const top = tops.get(l.lock?.source);
            if (top === undefined || l.fence > top.fence) tops.set(l.lock?.source, l);
          }
          for (const top of tops.values()) expect(await write(top)).toBe('applied');
        }
        for (const stale of leases) {
          const higher = leases.filter((l) => l.lock?.source === stale.lock?.source && l.fence > stale.fence);
          if (higher.length === 0) continue;
          expect(await write(stale), `fence ${stale.fence} (${stale.lock?.source}) after ${higher[0]?.fence}`).toBe(
            'stale',
          );
        }
      } finally {
        proxy.release();
        await Promise.allSettled(pending);
        await split.close();
        await other.close();
        if (kind === 'redis') {
          const left = await redis.keys(`*${namespace}*`);
          if (left.length > 0) await redis.del(...left);
        }
        redis.disconnect();
        proxy.close();
        await viaProxy.end({ timeout: 2 });
        await direct.end({ timeout: 2 });
        await scenario.close();
      }
    },
    propertyTimeout(2_000_000), // ~0.5 s a run (Redis ~1.5 s): a database of its own
  );
});
