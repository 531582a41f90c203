/**
 * One worker process of the chaos run (scripts/chaos.ts starts N of them).
 *
 * Loops, until told `stop` on stdin or its own time bound passes:
 * acquire the shared lock (bounded wait) → hold it for a random moment (the
 * window in which the runner's SIGSTOP makes it stale) → in ONE transaction,
 * `modify` the counter row (+1) with the lease's fence and, only if that
 * applied, append an audit row (after the fenced write, which holds the row
 * lock, so audit ids follow commit order) → release.
 *
 * It does NOT look at `lease.signal` before writing (unless `checkSignal`):
 * the point is that the database refuses a stale write, not that the worker
 * is polite. Every operation goes to the shared JSON Lines history
 * (invoke, then ok / fail / unknown); stdout carries short JSON messages the
 * runner uses to aim its faults (`acquired`, `wrote`, `released`).
 *
 * argv[2]: JSON {@link ChaosWorkerArgs}.
 */
import { createInterface } from 'node:readline';
import { pathToFileURL } from 'node:url';
import { bigint, bigserial, integer, pgTable, text } from 'drizzle-orm/pg-core';
import { transaction } from '../src/driver.js';
import type { Lease } from '../src/fencing/lease.js';
import { fencedRepository } from '../src/repo/repository.js';
import { fenceColumns } from '../src/schema/fence-columns.js';
import { historyRecorder } from '../src/testing/history.js';
import { type BackendKind, openManager } from '../test/support/managers.js';

/** What the runner passes to each worker. */
export interface ChaosWorkerArgs {
  readonly kind: BackendKind;
  readonly namespace: string;
  readonly databaseUrl: string;
  readonly redisUrl?: string;
  /** Stable label: a restarted worker keeps it (the OS pid changes). */
  readonly process: string;
  readonly lock: string;
  /** The counter row's id. */
  readonly key: string;
  readonly ttlMs: number;
  readonly waitMs: number;
  /** The hold before the write lasts a random 0 … holdMs. */
  readonly holdMs: number;
  /** JSON Lines file shared by every worker. */
  readonly history: string;
  /** Skip the write when the lease's signal has fired (off by default: the database must refuse). */
  readonly checkSignal: boolean;
  /** The worker exits on its own after this long, even if never told to stop. */
  readonly maxRunMs: number;
}

/** The shared counter: a fenced table. */
export const chaosCounter = pgTable('chaos_counter', {
  id: text('id').primaryKey(),
  n: integer('n').notNull().default(0),
  ...fenceColumns(),
});

/** One row per accepted increment, inserted after the fenced write in its transaction. */
export const chaosAudit = pgTable('chaos_audit', {
  id: bigserial('id', { mode: 'bigint' }).primaryKey(),
  key: text('key').notNull(),
  fence: bigint('fence', { mode: 'bigint' }).notNull(),
  process: text('process').notNull(),
  value: integer('value').notNull(),
});

/** The DDL the runner applies to each run's fresh database. */
export const CHAOS_DDL = [
  `create table chaos_counter (id text primary key, n integer not null default 0,
     last_fence bigint not null default 0, deleted_at timestamptz)`,
  `create table chaos_audit (id bigserial primary key, key text not null, fence bigint not null,
     process text not null, value integer not null)`,
];

async function main(): Promise<void> {
  const args = JSON.parse(process.argv[2] ?? '{}') as ChaosWorkerArgs;
  const record = historyRecorder(args.history, args.process);
  const say = (event: string, data: Record<string, unknown> = {}) =>
    process.stdout.write(`${JSON.stringify({ event, ...data })}\n`);
  const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
  const codeOf = (err: unknown) => String((err as { code?: unknown })?.code ?? (err as Error)?.name ?? 'error');

  record({ type: 'ok', op: 'start' });
  const { manager, db, close } = await openManager(args);
  const stopAt = Date.now() + args.maxRunMs;
  let stopping = false;
  createInterface({ input: process.stdin }).on('line', (line) => {
    if (line.includes('stop')) stopping = true;
  });
  // Tell the runner which backend sessions to aim at, and that we are up.
  say('ready', { pid: process.pid });

  while (!stopping && Date.now() < stopAt) {
    record({ type: 'invoke', op: 'acquire', lock: args.lock });
    let lease: Lease;
    try {
      lease = await manager.acquire(args.lock, { ttlMs: args.ttlMs, waitMs: args.waitMs, holder: args.process });
    } catch (err) {
      const code = codeOf(err);
      // A bounded wait that ended is a certain failure; anything else (a dropped connection) may have granted.
      record({ type: code === 'lock_unavailable' ? 'fail' : 'unknown', op: 'acquire', lock: args.lock, reason: code });
      await sleep(20 + Math.random() * 80);
      continue;
    }
    const fence = lease.fence.toString();
    record({ type: 'ok', op: 'acquire', lock: args.lock, fence });
    say('acquired', { fence });

    await sleep(Math.random() * args.holdMs);

    if (args.checkSignal && lease.signal.aborted) {
      say('skipped', { fence });
    } else {
      record({ type: 'invoke', op: 'increment', key: args.key, fence });
      try {
        const result = await transaction(db, async (tx) => {
          const r = await fencedRepository(tx, chaosCounter).modify({ id: args.key }, lease.fence, (row) => ({
            n: row.n + 1,
          }));
          if (r.status === 'applied') {
            await tx
              .insert(chaosAudit)
              .values({ key: args.key, fence: lease.fence, process: args.process, value: r.row.n });
          }
          return r;
        });
        if (result.status === 'applied') {
          record({ type: 'ok', op: 'increment', key: args.key, fence, value: result.row.n });
        } else {
          record({ type: 'fail', op: 'increment', key: args.key, fence, reason: result.status });
        }
        say('wrote', { fence, status: result.status });
      } catch (err) {
        const code = codeOf(err);
        // `retryable` (40001/40P01) rolled back: certainly not applied. Anything else: the commit may have landed.
        record({
          type: code === 'retryable' ? 'fail' : 'unknown',
          op: 'increment',
          key: args.key,
          fence,
          reason: code,
        });
        say('wrote', { fence, status: code });
      }
    }

    record({ type: 'invoke', op: 'release', lock: args.lock, fence });
    try {
      const released = await lease.release();
      record({ type: 'ok', op: 'release', lock: args.lock, fence, reason: released });
    } catch (err) {
      record({ type: 'unknown', op: 'release', lock: args.lock, fence, reason: codeOf(err) });
    }
    say('released', { fence });
  }

  await close();
  say('exit');
  process.exit(0);
}

// Only as a process of its own: the runner imports the table definitions.
if (process.argv[1] && pathToFileURL(process.argv[1]).href === import.meta.url) {
  await main();
}
