/**
 * Fence source id changes while two Postgres lock managers grant one lock
 * (README, "Two scopes of fencing"), searched: random sequences of grants
 * by either manager, changes of `palisade.fence_sources`, and grants whose
 * link delivers the statement's Bind and holds back its Execute (a lost
 * segment) until a later step. Checked against what the README promises:
 *
 * - per lock, in fence order, a source once left behind is never named
 *   again (the checker's rule: one counter, one register per lock);
 * - a holder is refused on a row nobody wrote once a higher fence of its
 *   lock, named by the same source, was granted — the grant claims.
 *
 * Each run on a fresh database; 60 runs at the full count.
 */
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { describe, expect } from 'vitest';
import type { Database } from '../../src/driver.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import type { Lease } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { checkHistory, type HistoryEvent } from '../../src/testing/index.js';
import { resource, scenarioDatabase, scenarioRows, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { withholdingProxy } from '../support/withholding-proxy.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

type Step = { readonly kind: 'grant'; readonly by: 'split' | 'direct' } | { readonly kind: 'change' | 'deliver' };

const stepArb: fc.Arbitrary<Step> = fc.oneof(
  { weight: 3, arbitrary: fc.record({ kind: fc.constant('grant' as const), by: fc.constantFrom('split', 'direct') }) },
  { weight: 1, arbitrary: fc.constant({ kind: 'change' } as const) },
  { weight: 1, arbitrary: fc.constant({ kind: 'deliver' } as const) },
);

type Kind = 'postgres' | 'advisory';

function managerOn(kind: Kind, client: postgres.Sql, namespace: string): LockManager {
  return kind === 'advisory'
    ? advisoryLockManager({ client, namespace })
    : postgresLockManager({ client: drizzle(client) as unknown as Database, namespace, listen: false });
}

describe.runIf(needs('DATABASE_URL'))('fence source id changes, searched', () => {
  test.prop(
    [fc.constantFrom<Kind>('postgres', 'advisory'), fc.array(stepArb, { minLength: 1, maxLength: 10 })],
    propertyParams({ numRuns: propertyRuns(60) }),
  )(
    "per lock the sources follow the fences, and a holder is refused once a higher fence of its lock's source was granted",
    async (kind, steps) => {
      const scenario = await scenarioDatabase();
      const proxy = withholdingProxy(scenario.url as string);
      const viaProxy = postgres(await proxy.url(), { max: 2, onnotice: () => {} });
      const direct = postgres(scenario.url as string, { max: 2, onnotice: () => {} });
      const namespace = uniqueNamespace('src');
      const split = managerOn(kind, viaProxy, namespace);
      const other = managerOn(kind, direct, namespace);
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

        // Every holder below the highest fence its source granted is refused on a row nobody wrote.
        const repo = fencedRepository(scenario.db, resource, { scope: 'lock' });
        const { newRow } = scenarioRows(() => scenario);
        for (const stale of leases) {
          const higher = leases.filter((l) => l.lock?.source === stale.lock?.source && l.fence > stale.fence);
          if (higher.length === 0) continue;
          const woken = { fence: stale.fence, lock: stale.lock, signal: new AbortController().signal };
          const result = await repo.with(woken).update({ id: await newRow() }, { value: 'stale' });
          expect(result.status, `fence ${stale.fence} (${stale.lock?.source}) after ${higher[0]?.fence}`).toBe('stale');
        }
      } finally {
        proxy.release();
        await Promise.allSettled(pending);
        await split.close();
        await other.close();
        proxy.close();
        await viaProxy.end({ timeout: 2 });
        await direct.end({ timeout: 2 });
        await scenario.close();
      }
    },
    propertyTimeout(1_000_000), // ~0.5 s a run: a database of its own
  );
});
