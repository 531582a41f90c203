/**
 * examples/nightly-report — the scheduler singleton on an advisory lock:
 * two replicas fire at once, exactly one runs the job,
 * the other skips and names the leader; a leader killed mid-job frees the
 * lock with its session.
 */
import { eq, sql } from 'drizzle-orm';
import { afterEach, describe, expect, it } from 'vitest';
import { reportRuns, reports, setup } from '../../examples/nightly-report/index.js';
import { count, execute } from '../../src/driver.js';
import { postgresDatabase } from '../support/databases.js';
import { killAllWorkers, type Message, startWorker, type Worker } from '../support/processes.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const WORKER = 'test/workers/example-worker.ts';
const DAY = '2026-11-29';

afterEach(killAllWorkers);

const example = (messages: Message[], type: string) => messages.filter((m) => m.event === 'example' && m.type === type);

/** Resolves with whichever worker reaches its hold point first. */
function firstHolding(workers: Worker[]): Promise<Worker> {
  return Promise.any(workers.map((w) => w.next((m) => m.event === 'holding', 60_000).then(() => w)));
}

describe.runIf(needs('DATABASE_URL'))(
  'examples/nightly-report (real Postgres, separate processes)',
  { timeout: 120_000 },
  () => {
    it('two schedulers fire at once: exactly one runs the job, the other skips naming it', async () => {
      const test = await postgresDatabase();
      try {
        await setup(test.db, DAY);
        const args = {
          example: 'nightly-report',
          databaseUrl: test.url,
          namespace: uniqueNamespace('sched'),
          options: { day: DAY },
          // The leader stays inside the job until told to go on: the other fires while it runs.
          holdAt: { type: 'computed' },
        };
        const replicas = [startWorker(WORKER, args), startWorker(WORKER, args)];
        const leader = await firstHolding(replicas);
        const other = replicas.find((w) => w !== leader) as Worker;
        const skipped = await other.next((m) => m.event === 'result', 60_000);
        expect(skipped.result).toEqual({ ran: false });
        const fence = String(example(leader.messages, 'leading')[0]?.fence);
        expect(example(other.messages, 'skipped')).toEqual([
          expect.objectContaining({ heldBy: `nightly-report pid ${leader.pid}`, fence }),
        ]);
        expect(example(other.messages, 'leading')).toEqual([]);
        leader.send({ cmd: 'go' });
        expect((await leader.next((m) => m.event === 'result', 30_000)).result).toEqual({
          ran: true,
          status: 'applied',
        });

        const runs = await test.db.select().from(reportRuns);
        expect(runs.map((r) => r.runner)).toEqual([`nightly-report pid ${leader.pid}`]);
        const [report] = await test.db.select().from(reports).where(eq(reports.day, DAY));
        expect(report).toMatchObject({
          orderCount: 4,
          revenueCents: 6550,
          builtBy: `nightly-report pid ${leader.pid}`,
          lastFence: BigInt(fence),
        });
      } finally {
        await test.close();
      }
    });

    it('a leader killed mid-job (kill -9) frees the lock with its session; the next run builds the report', async () => {
      const test = await postgresDatabase();
      try {
        await setup(test.db, DAY);
        const base = { example: 'nightly-report', databaseUrl: test.url, namespace: uniqueNamespace('sched') };
        const doomed = startWorker(WORKER, { ...base, options: { day: DAY }, holdAt: { type: 'computed' } });
        await doomed.next((m) => m.event === 'holding', 60_000);
        const advisoryHeld = async () =>
          count(
            (
              await execute(
                test.db,
                sql`select count(*) as n from pg_locks where locktype = 'advisory' and granted
                  and database = (select oid from pg_database where datname = current_database())`,
              )
            )[0]?.n,
          );
        expect(await advisoryHeld()).toBe(1);
        doomed.kill();
        await doomed.exited;
        // Bounded: the server ends the dead session within moments (at most 200 × 50 ms).
        for (let i = 0; i < 200 && (await advisoryHeld()) > 0; i++) await new Promise((r) => setTimeout(r, 50));
        expect(await advisoryHeld()).toBe(0);

        const next = startWorker(WORKER, { ...base, options: { day: DAY } });
        expect((await next.next((m) => m.event === 'result', 60_000)).result).toEqual({ ran: true, status: 'applied' });
        expect((await test.db.select().from(reportRuns)).map((r) => r.runner)).toEqual([
          `nightly-report pid ${doomed.pid}`,
          `nightly-report pid ${next.pid}`,
        ]);
        const [report] = await test.db.select().from(reports).where(eq(reports.day, DAY));
        expect(report?.builtBy).toBe(`nightly-report pid ${next.pid}`);
      } finally {
        await test.close();
      }
    });
  },
);
