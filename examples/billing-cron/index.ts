/**
 * billing-cron — two crons, one lock, done right.
 *
 * The story. A billing cron runs on two hosts for high availability. Each
 * night it takes a lock, charges every active subscription, releases. Some
 * months a few customers are charged twice, and the team insists "the lock
 * works — we tested it". It does work — as an *efficiency* lock. One night
 * host A stalls (a GC pause, a throttled VM) past the lock's TTL; host B
 * takes the lock and charges everyone; A wakes up and goes on charging.
 *
 * Charging is a *correctness* operation: a double charge moves money. So the
 * lock is only the first of three layers here:
 *
 * 1. The lock — a palisade lease: unique token, TTL, token-checked release,
 *    a watchdog extending it while the run is alive. It makes an overlap
 *    unlikely, and a run that knows it lost its lease stops.
 * 2. Fenced writes — a run claims each subscription, and marks it charged,
 *    with the lease's fence. Once a newer run has written a subscription,
 *    Postgres refuses the old run's writes: it stops there.
 * 3. An idempotency key per (subscription, period), sent to the payment
 *    provider, which honours it (like Stripe's `Idempotency-Key`). Nothing
 *    can fence an external API, and a paused run may be *between* its last
 *    check and the call — that one call is deduplicated by the provider. So
 *    is the retry after a crash between the charge and the bookkeeping.
 *
 * The lock reduces the probability of overlap; the fence and the idempotency
 * key make a double charge impossible.
 *
 * Run it (twice at once, in two terminals, to see one wait for the other):
 *
 *   DATABASE_URL=postgres://… npx tsx examples/billing-cron/index.ts --period 2026-11
 */
import { parseArgs } from 'node:util';
import { and, asc, eq, isNull, lt, or, sql } from 'drizzle-orm';
import { boolean, integer, pgTable, text, timestamp } from 'drizzle-orm/pg-core';
import {
  type Database,
  type Fence,
  fenceColumns,
  fencedRepository,
  type LockManager,
  LockUnavailableError,
  migrate,
  postgresLockManager,
} from 'palisade-db';
import { connectFromEnv, createTables, holderLabel, isMain, logEvents } from '../shared.js';

export const subscriptions = pgTable('billing_subscriptions', {
  id: integer('id').primaryKey(),
  customer: text('customer').notNull(),
  amountCents: integer('amount_cents').notNull(),
  active: boolean('active').notNull().default(true),
  /** The period a run has claimed and is charging now. */
  chargingPeriod: text('charging_period'),
  /** The last period (`YYYY-MM`) this subscription was charged for. */
  lastChargedPeriod: text('last_charged_period'),
  ...fenceColumns(),
});

/** The payment provider's side, simulated in the same database: one row per idempotency key. */
export const providerCharges = pgTable('billing_provider_charges', {
  idempotencyKey: text('idempotency_key').primaryKey(),
  customer: text('customer').notNull(),
  amountCents: integer('amount_cents').notNull(),
  /** How many requests carried this key: the first charged, the others were answered from the record. */
  requests: integer('requests').notNull().default(1),
  chargedAt: timestamp('charged_at', { withTimezone: true }).notNull().defaultNow(),
});

/** Creates the tables (palisade's too) and a few subscriptions, if not there yet. */
export async function setup(db: Database): Promise<void> {
  await migrate(db);
  await createTables(db, [
    sql`create table if not exists billing_subscriptions (
      id integer primary key, customer text not null, amount_cents integer not null,
      active boolean not null default true, charging_period text, last_charged_period text,
      last_fence bigint not null default 0, deleted_at timestamptz)`,
    sql`create table if not exists billing_provider_charges (
      idempotency_key text primary key, customer text not null, amount_cents integer not null,
      requests integer not null default 1, charged_at timestamptz not null default now())`,
  ]);
  await db
    .insert(subscriptions)
    .values([
      { id: 1, customer: 'ada', amountCents: 1200 },
      { id: 2, customer: 'grace', amountCents: 4900 },
      { id: 3, customer: 'edsger', amountCents: 1200 },
      { id: 4, customer: 'barbara', amountCents: 9900 },
      { id: 5, customer: 'alan', amountCents: 1200, active: false },
    ])
    .onConflictDoNothing();
}

/**
 * The payment provider's API, simulated: charges once per idempotency key;
 * a repeated key is answered with the original charge (`replayed`).
 */
export async function chargeCard(
  db: Database,
  charge: { idempotencyKey: string; customer: string; amountCents: number },
): Promise<{ replayed: boolean }> {
  const [row] = await db
    .insert(providerCharges)
    .values(charge)
    .onConflictDoUpdate({
      target: providerCharges.idempotencyKey,
      set: { requests: sql`${providerCharges.requests} + 1` },
    })
    .returning({ created: sql<boolean>`xmax = 0` });
  return { replayed: row?.created !== true };
}

export type BillingEvent =
  | { type: 'waiting-for-lock' }
  | { type: 'skipped'; reason: string }
  | { type: 'acquired'; fence: Fence; due: number[] }
  | { type: 'charging'; subscription: number; customer: string }
  | { type: 'charged'; subscription: number; replayed: boolean }
  | { type: 'taken-over'; subscription: number; step: 'claim' | 'complete'; currentFence: string | null }
  | { type: 'lease-lost'; subscription: number }
  | { type: 'released'; result: 'released' | 'lost' };

export interface BillingOptions {
  readonly db: Database;
  readonly locks: LockManager;
  /** The billing period, `YYYY-MM`. */
  readonly period: string;
  readonly ttlMs?: number;
  /** How long to wait for another run to finish (default 0: skip if one is running). */
  readonly waitMs?: number;
  /** Awaited at each step: log it, count it, or (in tests) hold the run at a chosen point. */
  readonly onEvent?: (event: BillingEvent) => void | Promise<void>;
}

export interface BillingResult {
  readonly status: 'done' | 'skipped' | 'taken-over' | 'lease-lost';
  /** Subscriptions this run charged (new charges). */
  readonly charged: number[];
  /** Subscriptions whose charge the provider answered from an earlier request. */
  readonly replayed: number[];
}

/**
 * One run of the cron for `period`. Guarantees: each active subscription is
 * charged at most once per period, whatever runs overlap, pause or crash
 * (fences + the provider's idempotency); once a newer run has written a
 * subscription this run stops. Does not: guarantee the run completes — a
 * run that stops or crashes leaves the rest to the next run, which picks up
 * every subscription not yet marked charged.
 */
export async function runBillingCron(options: BillingOptions): Promise<BillingResult> {
  const { db, locks, period } = options;
  const emit = async (event: BillingEvent) => options.onEvent?.(event);
  const charged: number[] = [];
  const replayed: number[] = [];
  const waitMs = options.waitMs ?? 0;
  if (waitMs > 0) await emit({ type: 'waiting-for-lock' });
  let lease: Awaited<ReturnType<LockManager['acquire']>>;
  try {
    lease = await locks.acquire('billing-cron', {
      ttlMs: options.ttlMs ?? 30_000,
      waitMs,
      holder: holderLabel('billing-cron'),
      autoExtend: true,
    });
  } catch (err) {
    if (!(err instanceof LockUnavailableError)) throw err;
    const info = await locks.inspect('billing-cron');
    await emit({
      type: 'skipped',
      reason: `another run holds the lock (${info?.holder ?? 'unknown'}, fence ${info?.fence})`,
    });
    return { status: 'skipped', charged, replayed };
  }

  // Several writes per subscription within one grant: claim, then complete.
  const repo = fencedRepository(db, subscriptions, { sameFence: 'allow' });
  try {
    const due = await db
      .select()
      .from(subscriptions)
      .where(
        and(
          eq(subscriptions.active, true),
          isNull(subscriptions.deletedAt),
          or(isNull(subscriptions.lastChargedPeriod), lt(subscriptions.lastChargedPeriod, period)),
        ),
      )
      .orderBy(asc(subscriptions.id));
    await emit({ type: 'acquired', fence: lease.fence, due: due.map((s) => s.id) });

    for (const sub of due) {
      // Layer 1: a run that knows it lost its lease stops before doing anything.
      if (lease.signal.aborted) {
        await emit({ type: 'lease-lost', subscription: sub.id });
        return { status: 'lease-lost', charged, replayed };
      }
      // Layer 2: claim the subscription with a fenced write.
      const claim = await repo.update({ id: sub.id }, lease.fence, { chargingPeriod: period });
      if (claim.status !== 'applied') {
        const currentFence = claim.status === 'stale' ? String(claim.currentFence) : null;
        await emit({ type: 'taken-over', subscription: sub.id, step: 'claim', currentFence });
        return { status: 'taken-over', charged, replayed };
      }
      await emit({ type: 'charging', subscription: sub.id, customer: sub.customer });
      // Layer 3: the charge carries an idempotency key per (subscription, period).
      const charge = await chargeCard(db, {
        idempotencyKey: `sub-${sub.id}:${period}`,
        customer: sub.customer,
        amountCents: sub.amountCents,
      });
      (charge.replayed ? replayed : charged).push(sub.id);
      await emit({ type: 'charged', subscription: sub.id, replayed: charge.replayed });
      const done = await repo.update({ id: sub.id }, lease.fence, { lastChargedPeriod: period, chargingPeriod: null });
      if (done.status !== 'applied') {
        const currentFence = done.status === 'stale' ? String(done.currentFence) : null;
        await emit({ type: 'taken-over', subscription: sub.id, step: 'complete', currentFence });
        return { status: 'taken-over', charged, replayed };
      }
    }
    return { status: 'done', charged, replayed };
  } finally {
    // Token-checked: a run whose lease was taken over deletes nothing.
    await emit({ type: 'released', result: await lease.release() });
  }
}

if (isMain(import.meta.url)) {
  const { values } = parseArgs({
    options: { period: { type: 'string' }, 'wait-ms': { type: 'string' }, 'ttl-ms': { type: 'string' } },
  });
  const period = values.period ?? new Date().toISOString().slice(0, 7);
  const { db, close } = connectFromEnv('billing-cron');
  const locks = postgresLockManager({ client: db, namespace: 'examples' });
  try {
    await setup(db);
    const result = await runBillingCron({
      db,
      locks,
      period,
      waitMs: Number(values['wait-ms'] ?? 0),
      ttlMs: Number(values['ttl-ms'] ?? 30_000),
      onEvent: logEvents('billing-cron'),
    });
    console.log(`[billing-cron ${process.pid}] ${result.status}: charged ${JSON.stringify(result.charged)}`);
  } finally {
    await locks.close();
    await close();
  }
}
