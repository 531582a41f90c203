/**
 * examples/backfill — resumable batches under a lease, each batch a fenced
 * write committed with its progress: a paused runner is refused, a second
 * runner cannot double-apply, a killed one is resumed, and rows written
 * meanwhile with newer fences roll the batch back until a fresh lease.
 */
import { asc, eq } from 'drizzle-orm';
import { afterEach, describe, expect, it } from 'vitest';
import { accounts, CREDIT, progress, setup } from '../../examples/backfill/index.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { killAllWorkers, type Message, startWorker } from '../support/processes.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const WORKER = 'test/workers/example-worker.ts';
const ACCOUNTS = 100;

afterEach(killAllWorkers);

const example = (messages: Message[], type: string) => messages.filter((m) => m.event === 'example' && m.type === type);
const resultOf = async (w: ReturnType<typeof startWorker>) =>
  (await w.next((m) => m.event === 'result' || m.event === 'error', 60_000)).result;

async function state(test: TestDatabase) {
  const rows = await test.db.select().from(accounts).orderBy(asc(accounts.id));
  const [p] = await test.db.select().from(progress);
  return {
    credited: rows.filter((r) => r.creditedAt !== null).map((r) => r.id),
    points: [...new Set(rows.map((r) => r.points))].sort((a, b) => a - b),
    progress: { lastId: p?.lastId, done: p?.done, fence: p?.lastFence },
  };
}

const range = (from: number, to: number) => Array.from({ length: to - from + 1 }, (_, i) => from + i);

describe.runIf(needs('DATABASE_URL'))(
  'examples/backfill (real Postgres, separate processes)',
  { timeout: 120_000 },
  () => {
    let test: TestDatabase;
    let base: { example: string; databaseUrl: string | undefined; namespace: string };
    const open = async () => {
      test = await postgresDatabase();
      await setup(test.db, ACCOUNTS);
      base = { example: 'backfill', databaseUrl: test.url, namespace: uniqueNamespace('backfill') };
    };

    it('a runner paused past its TTL is refused by the fence when it wakes; every account credited once', async () => {
      await open();
      try {
        const a = startWorker(WORKER, { ...base, options: { ttlMs: 1000 }, holdAt: { type: 'batch', from: 25 } });
        await a.next((m) => m.event === 'holding', 60_000);
        a.pause();
        // B's own TTL is long: renewed every third of it, a 1 s lease was lost on a loaded machine (CI once).
        const b = startWorker(WORKER, { ...base, options: { ttlMs: 10_000, waitMs: 30_000 } });
        expect(await resultOf(b)).toEqual({ status: 'done', credited: 75 });
        expect(example(b.messages, 'resumed')[0]?.from).toBe(25);
        a.resume();
        a.send({ cmd: 'go' });
        expect(await resultOf(a)).toEqual({ status: 'refused', credited: 25 });
        const bFence = String(example(b.messages, 'resumed')[0]?.fence);
        expect(example(a.messages, 'refused')).toEqual([expect.objectContaining({ to: 50, currentFence: bFence })]);
        expect(await state(test)).toEqual({
          credited: range(1, ACCOUNTS),
          points: [CREDIT],
          progress: { lastId: ACCOUNTS, done: true, fence: BigInt(bFence) },
        });
      } finally {
        await test.close();
      }
    });

    it('a second runner started meanwhile waits, then finds nothing left: no double credit', async () => {
      await open();
      const observer = postgresLockManager({ client: test.db, namespace: base.namespace, listen: false });
      try {
        const a = startWorker(WORKER, { ...base, options: { ttlMs: 5000 }, holdAt: { type: 'batch', from: 25 } });
        await a.next((m) => m.event === 'holding', 60_000);
        const b = startWorker(WORKER, { ...base, options: { ttlMs: 5000, waitMs: 60_000 } });
        await b.next((m) => m.event === 'example' && m.type === 'waiting-for-lock', 60_000);
        expect((await observer.inspect('backfill:welcome-credit'))?.holder).toBe(`backfill pid ${a.pid}`);
        expect(example(b.messages, 'resumed')).toEqual([]);
        a.send({ cmd: 'go' });
        expect(await resultOf(a)).toEqual({ status: 'done', credited: ACCOUNTS });
        expect(await resultOf(b)).toEqual({ status: 'done', credited: 0 });
        expect(example(b.messages, 'resumed')[0]?.from).toBe(ACCOUNTS);
        expect((await state(test)).points).toEqual([CREDIT]);
      } finally {
        await observer.close();
        await test.close();
      }
    });

    it('a runner killed mid-way (kill -9) is resumed after the last committed batch', async () => {
      await open();
      const observer = postgresLockManager({ client: test.db, namespace: base.namespace, listen: false });
      try {
        const a = startWorker(WORKER, { ...base, options: { ttlMs: 1000 }, holdAt: { type: 'batch', from: 50 } });
        await a.next((m) => m.event === 'holding', 60_000);
        a.kill();
        await a.exited;
        expect((await state(test)).credited).toEqual(range(1, 50));
        expect((await state(test)).progress.lastId).toBe(50);
        // Bounded: the dead runner's lease expires by TTL (at most 200 × 50 ms).
        for (let i = 0; i < 200 && (await observer.inspect('backfill:welcome-credit')) !== null; i++) {
          await new Promise((r) => setTimeout(r, 50));
        }
        const c = startWorker(WORKER, { ...base, options: { ttlMs: 10_000 } }); // its own TTL long, as B's above
        expect(await resultOf(c)).toEqual({ status: 'done', credited: 50 });
        expect(example(c.messages, 'resumed')[0]?.from).toBe(50);
        expect(example(c.messages, 'batch').map((m) => m.from)).toEqual([50, 75]);
        const s = await state(test);
        expect([s.credited, s.points, s.progress.lastId]).toEqual([range(1, ACCOUNTS), [CREDIT], ACCOUNTS]);
      } finally {
        await observer.close();
        await test.close();
      }
    });

    it('rows written meanwhile with newer fences roll the batch back; a rerun with a fresh lease completes', async () => {
      await open();
      const app = postgresLockManager({ client: test.db, namespace: uniqueNamespace('app'), listen: false });
      try {
        const a = startWorker(WORKER, { ...base, options: { ttlMs: 5000 }, holdAt: { type: 'batch', from: 25 } });
        await a.next((m) => m.event === 'holding', 60_000);
        // The application updates account 30 under a lock of its own, granted after the backfill's lease.
        await app.using('account:30', { ttlMs: 5000 }, async (lease) => {
          const r = await fencedRepository(test.db, accounts).update({ id: 30 }, lease.fence, {
            email: 'new@example.com',
          });
          expect(r.status).toBe('applied');
        });
        a.send({ cmd: 'go' });
        expect(await resultOf(a)).toEqual({ status: 'stale-rows', credited: 25 });
        expect(example(a.messages, 'stale-rows')).toEqual([expect.objectContaining({ to: 50, rows: 1 })]);
        const half = await state(test);
        expect([half.credited, half.progress.lastId]).toEqual([range(1, 25), 25]);

        const rerun = startWorker(WORKER, { ...base, options: { ttlMs: 5000 } });
        expect(await resultOf(rerun)).toEqual({ status: 'done', credited: 75 });
        const s = await state(test);
        expect([s.credited, s.points]).toEqual([range(1, ACCOUNTS), [CREDIT]]);
        const [thirty] = await test.db
          .select({ email: accounts.email, points: accounts.points })
          .from(accounts)
          .where(eq(accounts.id, 30));
        expect(thirty).toEqual({ email: 'new@example.com', points: CREDIT });
      } finally {
        await app.close();
        await test.close();
      }
    });
  },
);
