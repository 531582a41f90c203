/**
 * nightly-report — the scheduler singleton.
 *
 * The story. The scheduler runs on two replicas for high availability, so at
 * 02:00 both fire the nightly report. Exactly one should build it; the other
 * should notice and skip — not wait, not build it a second time.
 *
 * The tool: a Postgres session-level advisory lock (`pg_try_advisory_lock`),
 * through palisade's advisory lock manager and `runIfLeader`: one attempt, no
 * waiting; the loser skips and can say who is running it. What comes for
 * free: no TTL to size against a crash — the lock lives in the leader's
 * database session, and when the leader dies its connection closes and the
 * lock is gone. palisade adds a fence to the lease and an idle-session
 * timeout, so a *hung* leader loses the lock too (its watchdog keeps a live
 * one's session busy).
 *
 * Efficiency or correctness? Building the report twice is waste — the lock
 * is enough for that. But a leader that hung, lost its session and woke up
 * must not overwrite a newer leader's report with its older numbers: the
 * report row is written with the lease's fence (a fenced upsert), so that
 * late write is refused.
 *
 * The lock prevents *concurrent* runs only: a replica whose clock fires
 * after the other has finished builds the report again. Harmless here (the
 * upsert writes the same numbers); where it is not, record completion per
 * day, as billing-cron does with its idempotency key.
 *
 * Run it (in two terminals at once — one builds for 3 s, the other skips):
 *
 *   DATABASE_URL=postgres://… npx tsx examples/nightly-report/index.ts --day 2026-11-29
 */
import { parseArgs } from 'node:util';
import { eq, sql } from 'drizzle-orm';
import { date, integer, pgTable, serial, text, timestamp } from 'drizzle-orm/pg-core';
import {
  advisoryLockManager,
  type Database,
  type Fence,
  fenceColumns,
  fencedRepository,
  type LockManager,
  migrate,
  runIfLeader,
} from 'palisade-db';
import { connectFromEnv, createTables, holderLabel, isMain, logEvents } from '../shared.js';

export const orders = pgTable('report_orders', {
  id: serial('id').primaryKey(),
  day: date('day').notNull(),
  amountCents: integer('amount_cents').notNull(),
});

/** One report per day, written with the leader's fence. */
export const reports = pgTable('nightly_reports', {
  day: date('day').primaryKey(),
  orderCount: integer('order_count').notNull(),
  revenueCents: integer('revenue_cents').notNull(),
  builtBy: text('built_by').notNull(),
  ...fenceColumns(),
});

/** Every time the job body started, by whom: the proof that only one replica ran it. */
export const reportRuns = pgTable('nightly_report_runs', {
  id: serial('id').primaryKey(),
  day: date('day').notNull(),
  runner: text('runner').notNull(),
  startedAt: timestamp('started_at', { withTimezone: true }).notNull().defaultNow(),
});

/** Creates the tables (palisade's too) and a day of orders, if not there yet. */
export async function setup(db: Database, day: string): Promise<void> {
  await migrate(db);
  await createTables(db, [
    sql`create table if not exists report_orders (id serial primary key, day date not null, amount_cents integer not null)`,
    sql`create table if not exists nightly_reports (day date primary key, order_count integer not null,
      revenue_cents integer not null, built_by text not null, last_fence bigint not null default 0, deleted_at timestamptz)`,
    sql`create table if not exists nightly_report_runs (id serial primary key, day date not null, runner text not null,
      started_at timestamptz not null default now())`,
  ]);
  const [existing] = await db.select({ n: sql<number>`count(*)::int` }).from(orders).where(eq(orders.day, day));
  if ((existing?.n ?? 0) === 0) {
    await db.insert(orders).values([1250, 990, 4000, 310].map((amountCents) => ({ day, amountCents })));
  }
}

export type ReportEvent =
  | { type: 'leading'; fence: Fence }
  | { type: 'computed'; orderCount: number; revenueCents: number }
  | { type: 'written'; status: string }
  | { type: 'skipped'; heldBy: string | null; fence: string | null };

export interface ReportOptions {
  readonly db: Database;
  /** An advisory lock manager (any lock manager works; the advisory one frees the lock when the leader dies). */
  readonly locks: LockManager;
  /** The day to report on, `YYYY-MM-DD`. */
  readonly day: string;
  readonly ttlMs?: number;
  /** Simulated time to render and mail the report (default 0). */
  readonly workMs?: number;
  /** Awaited at each step: log it, or (in tests) hold the leader inside the job. */
  readonly onEvent?: (event: ReportEvent) => void | Promise<void>;
}

/**
 * Fires the nightly report on this replica. Guarantees: the job body runs
 * only on the replica holding the lock, at most once per call, and the
 * report row is only written with a fence above any earlier writer's. Does
 * not: retry on a skipped replica, or stop a leader that lost its lock
 * mid-job (its late write is refused instead).
 */
export async function runNightlyReport(options: ReportOptions): Promise<{ ran: boolean; status?: string }> {
  const { db, locks, day } = options;
  const emit = async (event: ReportEvent) => options.onEvent?.(event);
  const name = 'nightly-report';
  const repo = fencedRepository(db, reports);
  const run = await runIfLeader(
    locks,
    name,
    async (lease) => {
      await emit({ type: 'leading', fence: lease.fence });
      await db.insert(reportRuns).values({ day, runner: holderLabel('nightly-report') });
      const [totals] = await db
        .select({ n: sql<number>`count(*)::int`, sum: sql<number>`coalesce(sum(${orders.amountCents}), 0)::int` })
        .from(orders)
        .where(eq(orders.day, day));
      const orderCount = totals?.n ?? 0;
      const revenueCents = totals?.sum ?? 0;
      await emit({ type: 'computed', orderCount, revenueCents });
      await new Promise((resolve) => setTimeout(resolve, options.workMs ?? 0));
      const written = await repo.upsert(
        { day, orderCount, revenueCents, builtBy: holderLabel('nightly-report') },
        lease.fence,
      );
      await emit({ type: 'written', status: written.status });
      return written.status;
    },
    // The watchdog keeps the lease's session busy; a hung leader's session times out after ttlMs.
    { ttlMs: options.ttlMs ?? 10_000, autoExtend: true, holder: holderLabel('nightly-report') },
  );
  if (!run.ran) {
    const info = await locks.inspect(name);
    await emit({ type: 'skipped', heldBy: info?.holder ?? null, fence: info ? String(info.fence) : null });
    return { ran: false };
  }
  return { ran: true, status: run.result };
}

if (isMain(import.meta.url)) {
  const { values } = parseArgs({ options: { day: { type: 'string' }, 'work-ms': { type: 'string' } } });
  const day = values.day ?? new Date().toISOString().slice(0, 10);
  const { sql: client, db, close } = connectFromEnv('nightly-report');
  const locks = advisoryLockManager({ client: client, namespace: 'examples' });
  try {
    await setup(db, day);
    const workMs = Number(values['work-ms'] ?? 3000);
    const result = await runNightlyReport({ db, locks, day, workMs, onEvent: logEvents('nightly-report') });
    console.log(`[nightly-report ${process.pid}] ${result.ran ? `built the report (${result.status})` : 'skipped'}`);
  } finally {
    await locks.close();
    await close();
  }
}
