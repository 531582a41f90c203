/**
 * Connections killed at random moments among fenced transactions that run at
 * once (README, "When the connection closes inside a transaction"), searched
 * on a REAL Postgres with both drivers. Where test/repo/lost-connection.test.ts
 * closes one connection at a gate it chose, here `pg_terminate_backend` comes
 * when it comes, as an operator's or a failover's does. Each run draws:
 *
 * - one to three fenced transactions at once, each on rows of its own, whose
 *   functions write through palisade (`with(lease)`), through drizzle
 *   itself, in a drizzle savepoint, through a nested palisade `modify`, or
 *   several palisade writes at once (`Promise.all`), sit idle on a timer,
 *   or give up (throw);
 * - one to three faults, each 0–40 ms after the calls start: a kill of one
 *   of the pool's sessions or of all of them (`pg_terminate_backend`), a
 *   reset of every connection on the way to the server (a TCP RST, as a
 *   network or a load balancer sends; the pool connects through a proxy),
 *   the calls' lease lost (its signal aborted), or both in one turn (the
 *   reset, then the loss from the turn's check phase, reported as a loss to
 *   a dropped connection: an advisory lease whose own session the reset
 *   took is lost that way);
 * - the pool's size (1 to 4 connections).
 *
 * The checks: every call settles, within 20 s; one that resolved applied and
 * all it wrote is visible; one that rejected did so with an `Error` of the
 * driver's or palisade's (never a `TypeError`), and what it wrote is
 * visible either not at all or — the kill came while its `COMMIT` was under
 * way, whose outcome no database can tell — all of it: never a part (and
 * not at all when its function threw), and then its `DatabaseError` says
 * the outcome is unknown (`outcomeUnknown`); once
 * every call settled, no session of the pool stays in a transaction; and
 * the process lives on (an uncaught error fails the run).
 */
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, LeaseLostError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { markLostToDroppedConnection } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { retryEndedSession } from '../support/reconnect.js';
import { createResource, resource } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { withholdingProxy } from '../support/withholding-proxy.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

// Rows 1…ROWS are the first call's, ROWS+1…2·ROWS the second's, and so on.
const ROWS = 4;
const MAX_CALLS = 3;
const SETTLE_MS = 20_000;
// node-postgres's client-side bound, and how long a `stall` holds the server's answers back: past it, and past
// the driver's ROLLBACK queued behind a statement it gave up on, which times out in the queue too.
const QUERY_TIMEOUT_MS = 300;
const STALL_MS = 900;

type Step =
  | { readonly t: 'write' | 'plain' | 'savepoint' | 'modify'; readonly row: number }
  | { readonly t: 'all'; readonly rows: readonly number[] }
  | { readonly t: 'wait'; readonly ms: number }
  | { readonly t: 'throw' };
interface Kill {
  readonly afterMs: number;
  readonly how: 'one' | 'all' | 'reset' | 'lose' | 'reset-lose' | 'stall';
}
interface Program {
  readonly calls: readonly (readonly Step[])[];
  readonly kills: readonly Kill[];
  readonly pool: number;
}

const row = fc.integer({ min: 1, max: ROWS });
const stepArb: fc.Arbitrary<Step> = fc.oneof(
  {
    weight: 4,
    arbitrary: fc.record({
      t: fc.constantFrom('write' as const, 'plain' as const, 'savepoint' as const, 'modify' as const),
      row,
    }),
  },
  {
    weight: 2,
    arbitrary: fc.record({
      t: fc.constant('all' as const),
      rows: fc.uniqueArray(row, { minLength: 2, maxLength: ROWS }),
    }),
  },
  // The function idle on a timer (a reset of its idle connection may come then), or giving up.
  { weight: 2, arbitrary: fc.record({ t: fc.constant('wait' as const), ms: fc.integer({ min: 0, max: 8 }) }) },
  { weight: 1, arbitrary: fc.record({ t: fc.constant('throw' as const) }) },
);
const programArb: fc.Arbitrary<Program> = fc.record({
  calls: fc.array(fc.array(stepArb, { minLength: 1, maxLength: 5 }), { minLength: 1, maxLength: MAX_CALLS }),
  kills: fc.array(
    fc.record({
      afterMs: fc.integer({ min: 0, max: 40 }),
      how: fc.constantFrom('one', 'all', 'reset', 'lose', 'reset-lose', 'stall'),
    }),
    {
      minLength: 1,
      maxLength: 3,
    },
  ),
  pool: fc.integer({ min: 1, max: 4 }),
});

// The rows a call's steps write, up to a step that throws.
const rowsOf = (steps: readonly Step[], call: number): Set<number> => {
  const upTo = steps.findIndex((s) => s.t === 'throw');
  return new Set(
    steps
      .slice(0, upTo < 0 ? steps.length : upTo)
      .flatMap((s) => (s.t === 'all' ? s.rows : 'row' in s ? [s.row] : []))
      .map((r) => call * ROWS + r),
  );
};
const throws = (steps: readonly Step[]) => steps.some((s) => s.t === 'throw');

class GaveUp extends Error {}

interface Pool {
  readonly db: Database;
  end(): Promise<void>;
}

// A pool whose sessions carry `application`, so that the kills find them and only them.
const pools = {
  'postgres.js'(url: string, max: number, application: string): Pool {
    // fetch_types off, as the README advises: postgres.js leaves the rejection of a type fetch killed at connect unhandled.
    const client = postgres(url, {
      max,
      onnotice: () => {},
      fetch_types: false,
      connection: { application_name: application },
    });
    // A connection killed inside a transaction stays busy for postgres.js, whose end() waits out its timeout (README).
    return { db: drizzlePostgres(client) as unknown as Database, end: () => client.end({ timeout: 0.1 }) };
  },
  'node-postgres'(url: string, max: number, application: string): Pool {
    // The client gives up on a statement a stall holds past QUERY_TIMEOUT_MS while the server runs it on.
    const pool = new pg.Pool({
      connectionString: url,
      max,
      application_name: application,
      query_timeout: QUERY_TIMEOUT_MS,
    });
    pool.on('error', () => {}); // an idle client's connection killed: the pool replaces it
    return { db: drizzleNodePostgres(pool) as unknown as Database, end: () => pool.end() };
  },
};

/** The call's outcome within `ms`, or 'unsettled'. */
async function within(call: Promise<unknown>, ms: number): Promise<unknown> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise((resolve) => {
    timer = setTimeout(() => resolve('unsettled'), ms);
  });
  try {
    return await Promise.race([
      call.then(
        (value) => ({ value }),
        (err: unknown) => ({ err }),
      ),
      late,
    ]);
  } finally {
    clearTimeout(timer);
  }
}

for (const driver of ['postgres.js', 'node-postgres'] as const) {
  describe.runIf(needs('DATABASE_URL'))(`${driver}: sessions killed among fenced transactions at once`, () => {
    let base: TestDatabase | undefined;
    let url = '';
    let locks: LockManager;
    let run = 0;
    const reached = {
      applied: 0,
      rejected: 0,
      committedInDoubt: 0,
      unknownNotKept: 0,
      retriedAfterReconnect: 0,
      slowestMs: 0,
    };

    beforeAll(async () => {
      base = await postgresDatabase({ max: 4 });
      url = base.url as string;
      await migrate(base.db);
      await createResource(base.db, ROWS * MAX_CALLS);
      // The lock manager on the test's own pool, which no kill touches.
      locks = postgresLockManager({ client: base.db, namespace: 'killprop' });
    }, 120_000);
    afterAll(async () => {
      await locks?.close();
      await base?.close();
    });

    test.prop([programArb], propertyParams({ numRuns: propertyRuns(120) }))(
      'every call settles; applied: all it wrote is visible; rejected: none or (a COMMIT in doubt) all, never a part; no session left in a transaction',
      async (program) => {
        run++;
        const admin = base?.db as Database;
        const application = `palisade_kill_${process.pid}_${run}`;
        const proxy = withholdingProxy(url);
        const pool = pools[driver](await proxy.url(), program.pool, application);
        // A lease per run: its fence is above every row's, whatever earlier runs committed.
        const lease = await locks.acquire('L', { ttlMs: 60_000 });
        // The calls hold it through a signal of the test's own, which a fault may abort.
        const lost = new AbortController();
        const holder = { fence: lease.fence, lock: lease.lock, signal: lost.signal };
        // `toDroppedConnection`: lost as a lease whose backend's session the reset took reports it (an advisory
        // lease), which palisade answers a turn later: a statement sent in the reset's own turn would strand the
        // postgres.js connection it goes out on (README, "When the connection closes inside a transaction").
        const lose = (toDroppedConnection = false) => {
          const error = new LeaseLostError('L', lease.fence, 'lost by the test');
          if (toDroppedConnection) markLostToDroppedConnection(error);
          lost.abort(error);
        };
        const repo = fencedRepository(pool.db, resource, { sameFence: 'allow' });
        const leased = repo.with(holder);
        try {
          const calls = program.calls.map((steps, call) => {
            const value = `r${run}c${call}`;
            const id = (r: number) => call * ROWS + r;
            return fencedTransaction(pool.db, holder, async (tx) => {
              for (const s of steps) {
                if (s.t === 'wait') await sleep(s.ms);
                else if (s.t === 'throw') throw new GaveUp('the function gave up');
                else if (s.t === 'all') await Promise.all(s.rows.map((r) => leased.update({ id: id(r) }, { value })));
                else if (s.t === 'write') await leased.update({ id: id(s.row) }, { value });
                else if (s.t === 'plain')
                  await tx.execute(sql`update resource set value = ${value} where id = ${id(s.row)}`);
                else if (s.t === 'savepoint')
                  await tx.transaction((inner) =>
                    inner.execute(sql`update resource set value = ${value} where id = ${id(s.row)}`),
                  );
                else await repo.modify({ id: id(s.row) }, lease.fence, async () => ({ value }));
              }
            });
          });
          const kills = (async () => {
            const started = performance.now();
            for (const kill of [...program.kills].sort((a, b) => a.afterMs - b.afterMs)) {
              await sleep(Math.max(0, kill.afterMs - (performance.now() - started)));
              if (kill.how === 'lose') lose();
              else if (kill.how === 'stall') {
                // A link that stops delivering the server's answers for a while, then delivers them late.
                // Awaited: the checks after the calls (and the next transaction) see the link delivering again.
                proxy.state.withhold = true;
                await sleep(STALL_MS);
                proxy.release();
              } else if (kill.how === 'reset' || kill.how === 'reset-lose') {
                proxy.reset();
                if (kill.how === 'reset-lose') setImmediate(() => lose(true));
              } else
                await execute(
                  admin,
                  kill.how === 'all'
                    ? sql`select pg_terminate_backend(pid) from pg_stat_activity where application_name = ${application}`
                    : sql`select pg_terminate_backend(pid) from pg_stat_activity where application_name = ${application}
                      order by random() limit 1`,
                );
            }
          })();
          const started = performance.now();
          const outcomes = await Promise.all(
            calls.map((call) =>
              within(call, SETTLE_MS).finally(() => {
                reached.slowestMs = Math.max(reached.slowestMs, Math.round(performance.now() - started));
              }),
            ),
          );
          await kills;
          const rows = await execute(admin, sql`select id, value from resource order by id`);
          const valueAt = new Map(rows.map((r) => [Number(r.id), String(r.value)]));
          for (const [call, outcome] of outcomes.entries()) {
            const context = `call ${call} of ${JSON.stringify(program)}: ${String((outcome as { err?: unknown }).err ?? JSON.stringify(outcome))}`;
            expect(outcome, context).not.toBe('unsettled');
            const written = [...rowsOf(program.calls[call] as Step[], call)];
            const visible = written.filter((r) => valueAt.get(r) === `r${run}c${call}`).length;
            const gaveUp = throws(program.calls[call] as Step[]);
            if ('value' in (outcome as object)) {
              expect(gaveUp, context).toBe(false);
              expect((outcome as { value: { status: string } }).value.status, context).toBe('applied');
              expect(visible, context).toBe(written.length);
              reached.applied++;
            } else {
              const { err } = outcome as { err: unknown };
              expect(err, context).toBeInstanceOf(Error);
              expect(err, context).not.toBeInstanceOf(TypeError);
              expect([0, written.length], context).toContain(visible);
              // A function that threw never reached COMMIT: nothing of it is visible.
              if (gaveUp) expect(visible, context).toBe(0);
              reached.rejected++;
              if (visible > 0) {
                // Its COMMIT was under way when the kill came: the error says the connection closed, never
                // that the transaction rolled back.
                expect(err, context).toBeInstanceOf(DatabaseError);
                expect((err as DatabaseError).sqlState, context).not.toBe('25P02');
                // ...and that its outcome is unknown: a failure it called known would have kept nothing.
                expect((err as DatabaseError).outcomeUnknown, context).toBe(true);
                reached.committedInDoubt++;
              } else if (err instanceof DatabaseError && err.outcomeUnknown) reached.unknownNotKept++;
            }
          }
          // Every call settled: no session of the pool is left in a transaction (the driver's own rollback
          // may still be on its way: bounded wait).
          let open = -1;
          for (let i = 0; i < 100 && open !== 0; i++) {
            if (i > 0) await sleep(20);
            const [count] = await execute(
              admin,
              sql`select count(*)::int as n from pg_stat_activity
                where application_name = ${application} and state like 'idle in transaction%'`,
            );
            open = Number(count?.n);
          }
          expect(open, `a session left in a transaction: ${JSON.stringify(program)}`).toBe(0);
          // The pool serves the next transaction: no connection it lent stays taken for good. A kill that
          // came after the calls may still be on its way to the driver (the next statement meets the closing
          // socket), and postgres.js hands the killed session's 57P01 to the first statement after a
          // reconnect (README, "When the connection closes inside a transaction"): retried, it goes through.
          const next = await within(
            retryEndedSession(
              () => fencedTransaction(pool.db, lease, (tx) => execute(tx, sql`select 1`)),
              4,
              () => reached.retriedAfterReconnect++,
            ),
            SETTLE_MS,
          );
          expect(next, `the next transaction on the pool: ${JSON.stringify(program)}`).toMatchObject({
            value: { status: 'applied' },
          });
        } finally {
          await lease.release().catch(() => {});
          await pool.end().catch(() => {});
          proxy.close();
        }
      },
      propertyTimeout(4_000_000),
    );

    afterAll(() => {
      // Not a check of the search's reach (kills land where they land); what it covered, for the log.
      console.log(`${driver}: killed connections, ${run} runs: ${JSON.stringify(reached)}`);
    });
  });
}
