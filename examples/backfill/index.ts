/**
 * backfill — a data migration run in resumable batches under a lease.
 *
 * The story. A release added loyalty points, and every existing account
 * gets a one-time welcome credit of 500 points. The table is large, so the
 * backfill runs in small batches (short transactions, no table-wide lock),
 * and it must survive being interrupted: a deploy kills it, a rerun must
 * resume where it stopped — not start over, and above all not credit anyone
 * twice. Two runners may be started by mistake; one may stall (a GC pause, a
 * throttled pod) past its lease and wake up later.
 *
 * A double credit corrupts balances: this is a correctness lock. The layers:
 *
 * 1. A lease on `backfill:<job>` (watchdog on) — one runner at a time,
 *    usually. A second runner waits for it (bounded) or gives up.
 * 2. The progress row is the fenced resource. Each batch is one transaction
 *    that first moves the progress row forward *with the lease's fence*,
 *    then credits the batch's accounts with a fenced `updateWhere`. A runner
 *    whose lease was taken over is refused at the first statement — Postgres
 *    rejects its fence — and its batch never lands. Progress and credits
 *    commit together, so a rerun resumes exactly after the last committed
 *    batch.
 * 3. Idempotency: only accounts not yet credited (`credited_at is null`)
 *    are credited, so even a batch that is replayed credits nobody twice.
 *
 * A caveat the fence makes visible: the accounts themselves are fenced
 * rows. If the application writes them through palisade with fences from
 * *other* locks granted after this lease, those rows carry newer fences and
 * the backfill's write is refused (`stale`). The batch is then rolled back
 * and the run stops with `stale-rows`; a rerun takes a fresh lease — a fence
 * above theirs, since one lock manager's fences are comparable across lock
 * names — and picks the batch up again.
 *
 * Run it (twice at once: the second waits, then finds nothing left to do):
 *
 *   DATABASE_URL=postgres://… npx tsx examples/backfill/index.ts --wait-ms 60000
 */
import { parseArgs } from 'node:util';
import { asc, eq, gt, isNull, lte, sql } from 'drizzle-orm';
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

export const accounts = pgTable('loyalty_accounts', {
  id: integer('id').primaryKey(),
  email: text('email').notNull(),
  points: integer('points').notNull().default(0),
  creditedAt: timestamp('credited_at', { withTimezone: true }),
  ...fenceColumns(),
});

/** Where each backfill job stands: the last account id whose batch committed. */
export const progress = pgTable('backfill_progress', {
  job: text('job').primaryKey(),
  lastId: integer('last_id').notNull().default(0),
  done: boolean('done').notNull().default(false),
  ...fenceColumns(),
});

export const JOB = 'welcome-credit';
export const CREDIT = 500;

/** Creates the tables (palisade's too), `accounts` accounts and the job's progress row, if not there yet. */
export async function setup(db: Database, accountCount = 100): Promise<void> {
  await migrate(db);
  await createTables(db, [
    sql`create table if not exists loyalty_accounts (id integer primary key, email text not null,
      points integer not null default 0, credited_at timestamptz,
      last_fence bigint not null default 0, deleted_at timestamptz)`,
    sql`create table if not exists backfill_progress (job text primary key, last_id integer not null default 0,
      done boolean not null default false, last_fence bigint not null default 0, deleted_at timestamptz)`,
  ]);
  await db
    .insert(accounts)
    .values(Array.from({ length: accountCount }, (_, i) => ({ id: i + 1, email: `user${i + 1}@example.com` })))
    .onConflictDoNothing();
  await db.insert(progress).values({ job: JOB }).onConflictDoNothing();
}

export type BackfillEvent =
  | { type: 'waiting-for-lock' }
  | { type: 'resumed'; fence: Fence; from: number }
  | { type: 'batch'; from: number; to: number }
  | { type: 'applied'; to: number; credited: number }
  | { type: 'refused'; to: number; currentFence: string | null }
  | { type: 'stale-rows'; to: number; rows: number }
  | { type: 'lease-lost'; at: number }
  | { type: 'finished'; credited: number };

export interface BackfillOptions {
  readonly db: Database;
  readonly locks: LockManager;
  /** Accounts per batch (default 25). */
  readonly batchSize?: number;
  readonly ttlMs?: number;
  /** How long to wait for a runner already at work (default 0: give up at once). */
  readonly waitMs?: number;
  /** Awaited at each step: log it, or (in tests) hold the runner between batches. */
  readonly onEvent?: (event: BackfillEvent) => void | Promise<void>;
}

export interface BackfillResult {
  readonly status: 'done' | 'busy' | 'refused' | 'stale-rows' | 'lease-lost';
  /** Accounts this run credited. */
  readonly credited: number;
}

/**
 * Runs (or resumes) the welcome-credit backfill. Guarantees: every account
 * is credited at most once, whatever runners overlap, pause or crash; a
 * batch and its progress commit together; a runner whose lease was taken
 * over writes nothing more. Does not: finish in one run when interrupted or
 * refused — rerun it, it resumes.
 */
export async function runBackfill(options: BackfillOptions): Promise<BackfillResult> {
  const { db, locks } = options;
  const batchSize = options.batchSize ?? 25;
  const emit = async (event: BackfillEvent) => options.onEvent?.(event);
  const waitMs = options.waitMs ?? 0;
  if (waitMs > 0) await emit({ type: 'waiting-for-lock' });
  let lease: Awaited<ReturnType<LockManager['acquire']>>;
  try {
    lease = await locks.acquire(`backfill:${JOB}`, {
      ttlMs: options.ttlMs ?? 30_000,
      waitMs,
      autoExtend: true,
      holder: holderLabel('backfill'),
    });
  } catch (err) {
    if (err instanceof LockUnavailableError) return { status: 'busy', credited: 0 };
    throw err;
  }
  let credited = 0;
  try {
    const [state] = await db.select().from(progress).where(eq(progress.job, JOB));
    if (!state) throw new Error(`no progress row for job ${JOB}: run setup first`);
    let lastId = state.lastId;
    await emit({ type: 'resumed', fence: lease.fence, from: lastId });

    // Bounded: each pass moves lastId forward, until no account is left.
    for (;;) {
      if (lease.signal.aborted) {
        await emit({ type: 'lease-lost', at: lastId });
        return { status: 'lease-lost', credited };
      }
      const ids = await db
        .select({ id: accounts.id })
        .from(accounts)
        .where(gt(accounts.id, lastId))
        .orderBy(asc(accounts.id))
        .limit(batchSize);
      const to = ids.at(-1)?.id;
      if (to === undefined) break;
      await emit({ type: 'batch', from: lastId, to });

      const from = lastId;
      const outcome = await db
        .transaction(async (tx) => {
          // The claim: our fence moves the progress row, or we are refused here.
          const claim = await fencedRepository(tx, progress, { sameFence: 'allow' }).update({ job: JOB }, lease.fence, {
            lastId: to,
          });
          if (claim.status !== 'applied') {
            return {
              kind: 'refused' as const,
              currentFence: claim.status === 'stale' ? String(claim.currentFence) : null,
            };
          }
          const batch = await fencedRepository(tx, accounts).updateWhere(
            sql`${gt(accounts.id, from)} and ${lte(accounts.id, to)} and ${isNull(accounts.creditedAt)}`,
            lease.fence,
            { points: sql`${accounts.points} + ${CREDIT}`, creditedAt: sql`now()` },
          );
          // Rows written meanwhile with newer fences: undo the whole batch (progress too).
          if (batch.stale > 0) throw new StaleRows(batch.stale);
          return { kind: 'applied' as const, credited: batch.applied };
        })
        .catch((err: unknown) => {
          if (err instanceof StaleRows) return { kind: 'stale-rows' as const, rows: err.rows };
          throw err;
        });

      if (outcome.kind === 'refused') {
        await emit({ type: 'refused', to, currentFence: outcome.currentFence });
        return { status: 'refused', credited };
      }
      if (outcome.kind === 'stale-rows') {
        await emit({ type: 'stale-rows', to, rows: outcome.rows });
        return { status: 'stale-rows', credited };
      }
      credited += outcome.credited;
      lastId = to;
      await emit({ type: 'applied', to, credited: outcome.credited });
    }
    await fencedRepository(db, progress, { sameFence: 'allow' }).update({ job: JOB }, lease.fence, { done: true });
    await emit({ type: 'finished', credited });
    return { status: 'done', credited };
  } finally {
    await lease.release();
  }
}

class StaleRows extends Error {
  constructor(readonly rows: number) {
    super(`${rows} rows carry newer fences`);
  }
}

if (isMain(import.meta.url)) {
  const { values } = parseArgs({
    options: { 'wait-ms': { type: 'string' }, 'batch-size': { type: 'string' }, 'ttl-ms': { type: 'string' } },
  });
  const { db, close } = connectFromEnv('backfill');
  const locks = postgresLockManager({ client: db, namespace: 'examples' });
  try {
    await setup(db);
    const result = await runBackfill({
      db,
      locks,
      waitMs: Number(values['wait-ms'] ?? 0),
      batchSize: Number(values['batch-size'] ?? 25),
      ttlMs: Number(values['ttl-ms'] ?? 30_000),
      onEvent: async (event) => {
        logEvents('backfill')(event);
        // A big table takes a while per batch: slow enough to start a second runner.
        if (event.type === 'applied') await new Promise((resolve) => setTimeout(resolve, 1000));
      },
    });
    console.log(`[backfill ${process.pid}] ${result.status}: credited ${result.credited} accounts`);
  } finally {
    await locks.close();
    await close();
  }
}
