/**
 * examples/billing-cron — two crons, one paused (SIGSTOP) past its lease's TTL in the middle of charging, and no
 * customer is charged twice.
 */
import { asc, sql } from 'drizzle-orm';
import { afterEach, describe, expect, it } from 'vitest';
import { providerCharges, setup, subscriptions } from '../../examples/billing-cron/index.js';
import { postgresDatabase } from '../support/databases.js';
import { killAllWorkers, type Message, startWorker } from '../support/processes.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const WORKER = 'test/workers/example-worker.ts';
const PERIOD = '2026-11';

afterEach(killAllWorkers);

const example = (messages: Message[], type: string) => messages.filter((m) => m.event === 'example' && m.type === type);

describe.runIf(needs('DATABASE_URL'))(
  'examples/billing-cron (real Postgres, separate processes)',
  { timeout: 120_000 },
  () => {
    it('cron A paused past its TTL mid-charge, cron B takes over: nobody is charged twice', async () => {
      const test = await postgresDatabase();
      try {
        await setup(test.db);
        const base = { example: 'billing-cron', databaseUrl: test.url, namespace: uniqueNamespace('billing') };
        const a = startWorker(WORKER, {
          ...base,
          options: { period: PERIOD, ttlMs: 1000 },
          holdAt: { type: 'charging', subscription: 3 },
        });
        // A has charged 1 and 2, claimed 3, and is about to call the provider for 3: freeze it there.
        await a.next((m) => m.event === 'holding');
        a.pause();
        const b = startWorker(WORKER, { ...base, options: { period: PERIOD, ttlMs: 1000, waitMs: 30_000 } });
        const bDone = await b.next((m) => m.event === 'result', 60_000);
        expect(bDone.result).toEqual({ status: 'done', charged: [3, 4], replayed: [] });
        a.resume();
        a.send({ cmd: 'go' });
        const aDone = await a.next((m) => m.event === 'result', 30_000);

        // A's one call in flight was answered from B's charge; its bookkeeping was refused by the fence.
        expect(aDone.result).toEqual({ status: 'taken-over', charged: [1, 2], replayed: [3] });
        const aFence = BigInt(String(example(a.messages, 'acquired')[0]?.fence));
        const bFence = BigInt(String(example(b.messages, 'acquired')[0]?.fence));
        expect(bFence).toBeGreaterThan(aFence);
        expect(example(b.messages, 'acquired')[0]?.due).toEqual([3, 4]);
        expect(example(a.messages, 'taken-over')).toEqual([
          expect.objectContaining({ subscription: 3, step: 'complete', currentFence: String(bFence) }),
        ]);
        // Token-checked release: A deleted nothing of B's.
        expect(example(a.messages, 'released')[0]?.result).toBe('lost');
        expect(example(b.messages, 'released')[0]?.result).toBe('released');

        const charges = await test.db.select().from(providerCharges).orderBy(asc(providerCharges.idempotencyKey));
        expect(charges.map((c) => [c.idempotencyKey, c.customer, c.requests])).toEqual([
          ['sub-1:2026-11', 'ada', 1],
          ['sub-2:2026-11', 'grace', 1],
          ['sub-3:2026-11', 'edsger', 2], // two requests, one charge
          ['sub-4:2026-11', 'barbara', 1],
        ]);
        const [perCustomer] = (await test.db.execute(
          sql`select max(n)::int as most from (select customer, count(*) as n from billing_provider_charges group by customer) c`,
        )) as unknown as { most: number }[];
        expect(perCustomer?.most).toBe(1);
        const subs = await test.db.select().from(subscriptions).orderBy(asc(subscriptions.id));
        expect(subs.map((s) => [s.id, s.lastChargedPeriod, s.chargingPeriod])).toEqual([
          [1, PERIOD, null],
          [2, PERIOD, null],
          [3, PERIOD, null],
          [4, PERIOD, null],
          [5, null, null], // inactive: never charged
        ]);
      } finally {
        await test.close();
      }
    });

    it('a second cron while one runs skips at once, naming the holder; a rerun charges nobody', async () => {
      const test = await postgresDatabase();
      try {
        await setup(test.db);
        const base = { example: 'billing-cron', databaseUrl: test.url, namespace: uniqueNamespace('billing') };
        const a = startWorker(WORKER, {
          ...base,
          options: { period: PERIOD, ttlMs: 5000 },
          holdAt: { type: 'charging', subscription: 1 },
        });
        await a.next((m) => m.event === 'holding');
        const c = startWorker(WORKER, { ...base, options: { period: PERIOD, ttlMs: 5000 } });
        const cDone = await c.next((m) => m.event === 'result', 30_000);
        expect(cDone.result).toEqual({ status: 'skipped', charged: [], replayed: [] });
        expect(String(example(c.messages, 'skipped')[0]?.reason)).toMatch(
          new RegExp(`^another run holds the lock \\(billing-cron pid ${a.pid}, fence \\d+\\)$`),
        );
        a.send({ cmd: 'go' });
        expect((await a.next((m) => m.event === 'result', 30_000)).result).toEqual({
          status: 'done',
          charged: [1, 2, 3, 4],
          replayed: [],
        });
        const rerun = startWorker(WORKER, { ...base, options: { period: PERIOD, ttlMs: 5000 } });
        expect((await rerun.next((m) => m.event === 'result', 30_000)).result).toEqual({
          status: 'done',
          charged: [],
          replayed: [],
        });
        const charges = await test.db.select().from(providerCharges);
        expect(charges.map((x) => x.requests)).toEqual([1, 1, 1, 1]);
      } finally {
        await test.close();
      }
    });
  },
);
