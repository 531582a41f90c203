/**
 * A transaction whose connection the server closed (README, "When the
 * connection closes inside a transaction"): both drivers would end the
 * process there — postgres.js when anything more is sent on the connection,
 * node-postgres when the checked-out client's `error` goes unheard — so the
 * call rejects with a `DatabaseError`, later statements on the transaction
 * reject, nothing it wrote is visible and the process lives on. The
 * function is held at a gate until the driver has seen the close (on
 * postgres.js the call has rejected, on node-postgres the client has
 * ended), so the close is processed before it goes on — in every run, not by
 * luck of timing. A property searches where the close comes in a function of
 * palisade writes, the caller's own statements and savepoints nested in
 * each other. Last, the LISTEN connection a lock manager checks out of a
 * node-postgres pool, closed by the server.
 */
import { fc } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, LeaseLostError, PalisadeError } from '../../src/errors.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { toFence } from '../../src/fencing/fence.js';
import type { Lease } from '../../src/fencing/lease.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { LeasedRepository } from '../../src/repo/repository-api.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { propertyParams, propertyRuns } from '../property/support.js';
import { nodePostgresDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import { retryEndedSession } from '../support/reconnect.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { withholdingProxy } from '../support/withholding-proxy.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });
const ROWS = 8;

function gate() {
  let open = () => {};
  const opened = new Promise<void>((resolve) => {
    open = resolve;
  });
  return { open, opened };
}

/** Bounded: until `done()` holds, or 5 s. */
async function until(done: () => boolean | Promise<boolean>) {
  for (let i = 0; i < 250 && !(await done()); i++) await sleep(20);
}

/** A few turns of the event loop: had the driver been left to end the process, it would have by then. */
const turns = () => sleep(50);

const settled = (call: Promise<unknown>) =>
  call.then(
    () => 'resolved',
    (err: unknown) => err,
  );

/** {@link settled} within `ms`, or undefined: a call that never settles fails the test, not its timeout. */
const within = (call: Promise<unknown>, ms = 10_000) => Promise.race([settled(call), sleep(ms)]);

// How the test knows the driver has seen the close. postgres.js races a transaction with its connection's
// close: the call rejects. node-postgres lets the transaction's function go on: its client has ended.
const drivers = [
  { name: 'postgres.js', open: postgresDatabase, seen: (call: Promise<unknown>) => call },
  {
    name: 'node-postgres',
    open: nodePostgresDatabase,
    seen: (_call: Promise<unknown>, tx: Database) =>
      new Promise((resolve) => {
        const { client } = (tx as unknown as { session: { client: { once(e: 'end', l: () => void): void } } }).session;
        // Ended already (a busy machine can be slower than a short idle timeout): heard.
        if ((client as { _ended?: boolean })._ended === true) resolve(undefined);
        else client.once('end', () => resolve(undefined));
      }),
  },
] as const;

/** Ends one backend from another session, as an operator or a failover would. */
async function terminate(db: Database, pid: number) {
  await execute(db, sql`select pg_terminate_backend(${pid})`);
}

async function backendPid(tx: Database): Promise<number> {
  const [row] = await execute(tx, sql`select pg_backend_pid() as pid`);
  return Number(row?.pid);
}

type Seen = (call: Promise<unknown>, tx: Database) => Promise<unknown>;

/**
 * A close at a gate: the function calls `stop(tx)`, where it waits; `close(db)` ends that backend from
 * another session and, once the driver has seen the close (`seen`), lets the function go on. `watch(call)`
 * is the call's outcome (settled, never rejected). With `idle`, the server's idle timeout does the closing.
 */
function closeAtGate(seen: Seen) {
  const inside = gate();
  const resume = gate();
  let pid = 0;
  let closed: Promise<unknown> = Promise.resolve();
  let outcome: Promise<unknown> = Promise.resolve();
  return {
    watch(call: Promise<unknown>) {
      outcome = settled(call);
      return outcome;
    },
    async stop(tx: Database) {
      pid = await backendPid(tx);
      closed = seen(outcome, tx);
      inside.open();
      await resume.opened;
    },
    async close(db: Database, { idle = false } = {}) {
      await inside.opened;
      if (!idle) await terminate(db, pid);
      await closed;
      resume.open();
    },
  };
}

/** Until backend `pid()` waits on `event` (a statement in flight there). */
async function untilWaiting(db: Database, pid: () => number, event: string) {
  await until(async () => {
    const [row] = await execute(
      db,
      sql`select count(*)::int as n from pg_stat_activity where pid = ${pid()} and wait_event = ${event}`,
    );
    return row?.n === 1;
  });
}

/** A fresh database on `open`'s driver: palisade migrated, `resource` rows 1..ROWS at 'initial'. */
async function scenario(open: (o: { migrated: boolean }) => Promise<TestDatabase>): Promise<TestDatabase> {
  const t = await open({ migrated: true });
  await execute(
    t.db,
    sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
  );
  await execute(t.db, sql`insert into resource (id, value) select g, 'initial' from generate_series(1, ${ROWS}) g`);
  return t;
}

/**
 * What each test starts from: `resource` at 'initial' and a lease of a lock no other test uses. A database
 * of its own per test, closed after it — after kills with a statement in flight, a later query of the same
 * postgres.js pool has failed with 57P01 (README, "When the connection closes inside a transaction") — or, `shared`, one
 * for the describe, reset between calls (for kills at a gate only).
 */
function testDatabases(open: (o: { migrated: boolean }) => Promise<TestDatabase>, { shared = false } = {}) {
  const opened: TestDatabase[] = [];
  const closeAll = async () => {
    await Promise.all(opened.splice(0).map((t) => t.close()));
  };
  if (shared) afterAll(closeAll);
  else afterEach(closeAll);
  return async () => {
    let t = shared ? opened[0] : undefined;
    if (t) await execute(t.db, sql`update resource set value = 'initial', last_fence = 0`);
    else {
      t = await scenario(open);
      opened.push(t);
    }
    const { db } = t;
    const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('lost') });
    const lease = await locks.acquire('L', { ttlMs: 60_000 });
    return { db, url: t.url, locks, lease, repo: fencedRepository(db, resource) };
  };
}

async function values(db: Database): Promise<string[]> {
  return (await execute(db, sql`select value from resource order by id`)).map((r) => String(r.value));
}
const untouched = Array.from({ length: ROWS }, () => 'initial');

// Row 2's writes wait in a trigger, so a write of it is in flight when the kill comes.
const SLOW_ROW_2 = `create function slow() returns trigger language plpgsql as $$
  begin if new.id = 2 then perform pg_sleep(30); end if; return new; end $$;
  create trigger slow before update on resource for each row execute function slow()`;

// What the function does once its connection is gone, and what that must come to.
const afterClose: Record<
  string,
  { act: (leased: LeasedRepository<typeof resource>, tx: Database) => Promise<unknown>; refused: boolean }
> = {
  'writes through palisade': { act: (leased) => leased.update({ id: 2 }, { value: 'late' }), refused: true },
  'writes through drizzle itself': {
    act: (_leased, tx) => tx.execute(sql`update resource set value = 'late' where id = 2`),
    refused: true,
  },
  'opens a savepoint through drizzle': {
    act: (_leased, tx) =>
      tx.transaction(async (inner) => inner.execute(sql`update resource set value = 'late' where id = 2`)),
    refused: true,
  },
  throws: {
    act: async () => {
      throw new Error('the function gave up');
    },
    refused: false,
  },
  returns: { act: async () => 'done', refused: false },
};

for (const { name, open, seen } of drivers) {
  describe.runIf(needs('DATABASE_URL'))(`${name}: a transaction whose connection the server closed`, () => {
    const fresh = testDatabases(open);

    for (const [what, { act, refused }] of Object.entries(afterClose)) {
      it(`fencedTransaction: closed by pg_terminate_backend, then the function ${what}: the call rejects, the process lives, nothing is visible`, async () => {
        const { db, locks, lease, repo } = await fresh();
        const at = closeAtGate(seen);
        let late: unknown;
        const outcome = at.watch(
          fencedTransaction(db, lease, async (tx) => {
            expect((await repo.with(lease).update({ id: 1 }, { value: 'written' })).status).toBe('applied');
            await at.stop(tx);
            late = await settled(act(repo.with(lease), tx));
            return 'done';
          }),
        );
        await at.close(db);
        expect(await outcome).toBeInstanceOf(DatabaseError);
        // Closed before the COMMIT went out: nothing committed, and the error says the outcome is known.
        expect([what, ((await outcome) as DatabaseError).outcomeUnknown]).toEqual([what, false]);
        await until(() => late !== undefined);
        // A statement after the close is refused (a write through palisade with a PalisadeError).
        if (refused) expect(late).toBeInstanceOf(what === 'writes through palisade' ? PalisadeError : Error);
        await turns();
        expect(await values(db)).toEqual(untouched);
        // The pool has connections to give again, and the lock's next grant goes through.
        await lease.release();
        const next = await locks.acquire('L', { ttlMs: 60_000, waitMs: 10_000 });
        expect((await repo.with(next).update({ id: 1 }, { value: 'next' })).status).toBe('applied');
        await next.release();
      });
    }

    it("modify: a statement through palisade after the close rejects with a PalisadeError, and the function's patch is not written", async () => {
      const { db, repo } = await fresh();
      const at = closeAtGate(seen);
      let late: unknown;
      const outcome = at.watch(
        repo.modify({ id: 1 }, toFence(5n), async (_row, tx) => {
          await at.stop(tx);
          late = await settled(execute(tx, sql`select 1`));
          return { value: 'modified' };
        }),
      );
      await at.close(db);
      expect(await outcome).toBeInstanceOf(DatabaseError);
      await until(() => late !== undefined);
      expect(late).toBeInstanceOf(PalisadeError);
      expect((late as PalisadeError).code).toBe('database');
      // On postgres.js the statement was refused unsent, and says so (not "an error from the driver").
      if (name === 'postgres.js') expect((late as Error).message).toMatch(/connection was closed/);
      expect(await values(db)).toEqual(untouched);
    });

    it("a statement in flight in the caller's own drizzle savepoint when the connection is killed: the call rejects, the process lives", async () => {
      const { db, lease } = await fresh();
      let pid = 0;
      const call = fencedTransaction(db, lease, async (tx) => {
        pid = await backendPid(tx);
        await tx.execute(sql`update resource set value = 'outer' where id = 1`);
        return tx.transaction(async (inner) => {
          await inner.execute(sql`update resource set value = 'inner' where id = 2`);
          await inner.execute(sql`select pg_sleep(30)`);
        });
      });
      const outcome = settled(call);
      await untilWaiting(db, () => pid, 'PgSleep');
      await terminate(db, pid);
      expect(await outcome).toBeInstanceOf(DatabaseError);
      await turns();
      expect(await values(db)).toEqual(untouched);
    });

    it.runIf(name === 'postgres.js')(
      "afterwards the client's end() without a timeout does not resolve: the driver still counts the transaction (README: end it with a timeout)",
      async () => {
        const { db, url, lease } = await fresh();
        // A client of its own: once end() has been called, a later end({ timeout }) returns the same promise.
        const own = postgres(url as string, { max: 1, onnotice: () => {} });
        let pid = 0;
        const outcome = settled(
          fencedTransaction(drizzle(own) as unknown as Database, lease, async (tx) => {
            pid = await backendPid(tx);
            await tx.execute(sql`select pg_sleep(30)`);
          }),
        );
        await untilWaiting(db, () => pid, 'PgSleep');
        await terminate(db, pid);
        expect(await outcome).toBeInstanceOf(DatabaseError);
        let ended = false;
        void own.end().then(() => {
          ended = true;
        });
        // Not a bound on time: were the transaction released, end() would resolve within these turns and a
        // round trip (the client's only connection is already closed); it must not resolve at all.
        await turns();
        expect(await values(db)).toEqual(untouched);
        expect(ended).toBe(false);
      },
    );

    for (const nested of ['modify', 'upsert', 'updateWhere'] as const) {
      it(`a palisade ${nested} nested in fencedTransaction, in flight when the connection is killed, rejects too: the function's own code goes on`, async () => {
        const { db, lease, repo } = await fresh();
        // Row 2's writes wait in a trigger, so the nested call is in flight when the kill comes.
        await execute(
          db,
          sql.raw(`create function slow() returns trigger language plpgsql as $$
            begin if new.id = 2 then perform pg_sleep(30); end if; return new; end $$;
            create trigger slow before update or insert on resource for each row execute function slow()`),
        );
        const leased = repo.with(lease);
        let pid = 0;
        let inner: unknown;
        const call = fencedTransaction(db, lease, async (tx) => {
          pid = await backendPid(tx);
          await leased.update({ id: 1 }, { value: 'written' });
          const write =
            nested === 'modify'
              ? repo.modify({ id: 2 }, lease.fence, async () => ({ value: 'nested' }))
              : nested === 'upsert'
                ? leased.upsert({ id: 2, value: 'nested' })
                : leased.updateWhere(sql`id = 2`, { value: 'nested' }, { allOrNothing: true });
          inner = await settled(write);
          return 'done';
        });
        const outcome = settled(call);
        await untilWaiting(db, () => pid, 'PgSleep');
        await terminate(db, pid);
        expect(await outcome).toBeInstanceOf(DatabaseError);
        await until(() => inner !== undefined);
        expect(inner).toBeInstanceOf(DatabaseError);
        expect(await values(db)).toEqual(untouched);
      });
    }

    for (const queuedCall of ['write', 'fencedTransaction'] as const)
      it(`a palisade ${queuedCall} queued behind a statement in flight when the connection is killed rejects too, and does not wait for good`, async () => {
        const { db, lease, repo } = await fresh();
        await execute(
          db,
          sql.raw(`create function slow() returns trigger language plpgsql as $$
          begin if new.id = 2 then perform pg_sleep(30); end if; return new; end $$;
          create trigger slow before update on resource for each row execute function slow()`),
        );
        const leased = repo.with(lease);
        let pid = 0;
        let first: unknown;
        let queued: unknown;
        const call = fencedTransaction(db, lease, async (tx) => {
          pid = await backendPid(tx);
          // The first run of a statement on this connection: postgres.js has it described before it binds
          // it, and takes no other statement of the transaction until it is done — the next one waits in
          // the driver's own queue of the transaction, not on the connection.
          const inFlight = settled(leased.update({ id: 2 }, { value: 'slow' })).then((o) => {
            first = o;
          });
          await sleep(0);
          const next =
            queuedCall === 'write'
              ? leased.update({ id: 3 }, { value: 'behind' })
              : fencedTransaction(db, lease, () => leased.update({ id: 3 }, { value: 'behind' }));
          const behind = settled(next).then((o) => {
            queued = o;
          });
          await Promise.all([inFlight, behind]);
          return 'done';
        });
        const outcome = settled(call);
        await untilWaiting(db, () => pid, 'PgSleep');
        await terminate(db, pid);
        expect(await outcome).toBeInstanceOf(DatabaseError);
        await until(() => queued !== undefined);
        expect(first).toBeInstanceOf(DatabaseError);
        expect(queued).toBeInstanceOf(DatabaseError);
        expect(await values(db)).toEqual(untouched);
      });

    for (const next of ['write', 'fencedTransaction', 'modify'] as const)
      it(`a palisade ${next} sent at once from the catch of a write the kill failed rejects, and the process lives`, async () => {
        const { db, lease, repo } = await fresh();
        await execute(db, sql.raw(SLOW_ROW_2));
        const leased = repo.with(lease);
        let pid = 0;
        let late: unknown;
        const call = fencedTransaction(db, lease, async (tx) => {
          pid = await backendPid(tx);
          try {
            await leased.update({ id: 2 }, { value: 'slow' });
          } catch {
            // In the same turn as the driver's news of the close: before the transaction's call has rejected.
            const again =
              next === 'write'
                ? leased.update({ id: 3 }, { value: 'again' })
                : next === 'fencedTransaction'
                  ? fencedTransaction(tx, lease, () => leased.update({ id: 3 }, { value: 'again' }))
                  : repo.modify({ id: 3 }, lease.fence, async () => ({ value: 'again' }));
            late = await settled(again);
          }
          return 'done';
        });
        const outcome = settled(call);
        await untilWaiting(db, () => pid, 'PgSleep');
        await terminate(db, pid);
        expect(await outcome).toBeInstanceOf(DatabaseError);
        await until(() => late !== undefined);
        expect(late).toBeInstanceOf(PalisadeError);
        await turns();
        expect(await values(db)).toEqual(untouched);
      });

    for (const ends of ['threw', 'returned'] as const)
      it(`writes the function left running when it ${ends} reject once the connection is killed, and do not wait for good`, async () => {
        const { db, lease, repo } = await fresh();
        await execute(db, sql.raw(SLOW_ROW_2));
        const leased = repo.with(lease);
        let pid = 0;
        const left: Record<string, unknown> = {};
        const leave = (name: string, write: Promise<unknown>) =>
          settled(write).then((o) => {
            left[name] = o;
          });
        const call = fencedTransaction(db, lease, async (tx) => {
          pid = await backendPid(tx);
          // A write in flight, one queued behind it, then the function gives up without awaiting them
          // (as a Promise.all that failed fast does): the driver's ROLLBACK waits behind them.
          void leave('inFlight', leased.update({ id: 2 }, { value: 'slow' }));
          await sleep(0);
          void leave('behind', leased.update({ id: 3 }, { value: 'behind' }));
          if (ends === 'threw') throw new Error('the function gave up');
          return 'done';
        });
        const outcome = settled(call);
        await untilWaiting(db, () => pid, 'PgSleep');
        await terminate(db, pid);
        expect(await outcome).toBeInstanceOf(Error);
        await until(() => left.inFlight !== undefined && left.behind !== undefined);
        expect(left.inFlight).toBeInstanceOf(DatabaseError);
        expect(left.behind).toBeInstanceOf(DatabaseError);
        expect(await values(db)).toEqual(untouched);
      });

    it('a pooled session ended just before a transaction checks it out: the call settles, the process lives, and a node-postgres pool lends again', async () => {
      const { db, url, lease } = await fresh();
      // A pool of one connection of its own: the one the transaction gets is the one just ended.
      // The statements a postgres.js client sent, last one last (its `debug` hook, set after creation: no stack
      // capture). Empty for node-postgres.
      let sent: string[] = [];
      const open = () => {
        sent = [];
        if (name === 'postgres.js') {
          const client = postgres(url as string, { max: 1, onnotice: () => {} });
          client.options.debug = (_connection: number, text: string) => {
            sent.push(text.trim());
          };
          return { db: drizzle(client) as unknown as Database, end: () => client.end({ timeout: 1 }) };
        }
        // A checkout that finds no connection to lend fails after 5 s rather than waiting for good.
        const pool = new pg.Pool({ connectionString: url as string, max: 1, connectionTimeoutMillis: 5_000 });
        pool.on('error', () => {});
        return { db: drizzleNodePostgres(pool) as unknown as Database, end: () => pool.end() };
      };
      // postgres.js gets a new client each trial: a kill whose news comes while the driver's own BEGIN waits to
      // be flushed leaves its connection never to connect again — postgres.js alone does so too (its own
      // `begin`, 2 of 50 such trials under load; README, "When the connection closes inside a transaction").
      // Only that may hold the pool back: nothing palisade sends.
      const clientEachTrial = name === 'postgres.js';
      let own = open();
      try {
        for (let trial = 0; trial < 6; trial++) {
          if (clientEachTrial && trial > 0) {
            await own.end();
            own = open();
          }
          const repo = fencedRepository(own.db, resource);
          const pid = await backendPid(own.db);
          await terminate(db, pid);
          // The news of the end reaches the client at once, a turn later, or while BEGIN is on its way.
          if (trial % 3 === 1) await new Promise((resolve) => setImmediate(resolve));
          if (trial % 3 === 2) await sleep(1);
          const outcome = await settled(
            fencedTransaction(own.db, lease, () => repo.with(lease).update({ id: 1 }, { value: `t${trial}` })),
          );
          if (outcome instanceof Error) expect(outcome).toBeInstanceOf(PalisadeError);
          // The pool's one connection was given back (or replaced): a call runs again.
          let again: unknown;
          const answered = await Promise.race([
            until(async () => {
              again = await backendPid(own.db).catch((err: unknown) => err);
              return typeof again === 'number';
            }).then(() => true),
            sleep(10_000).then(() => false),
          ]);
          if (answered || !clientEachTrial) expect(again).toEqual(expect.any(Number));
          else expect(sent.at(-1)?.toLowerCase()).toBe('begin');
        }
      } finally {
        await own.end();
      }
    });

    it.runIf(name === 'node-postgres')(
      'sessions of a pool ended again and again while transactions check them out: every call settles, the process lives',
      async () => {
        const { db, url, lease } = await fresh();
        const application = `palisade_checkout_${process.pid}`;
        const pool = new pg.Pool({ connectionString: url as string, max: 1, application_name: application });
        pool.on('error', () => {});
        const own = drizzleNodePostgres(pool) as unknown as Database;
        let stop = false;
        // Ends the pool's session every 0–3 ms: sometimes the server's FATAL comes in the same read as the
        // answer before it, and the client emits it as the pool lends it.
        const killer = (async () => {
          for (let i = 0; !stop && i < 20_000; i++) {
            await execute(
              db,
              sql`select pg_terminate_backend(pid) from pg_stat_activity where application_name = ${application}`,
            );
            if (i % 3 === 0) await sleep(Math.random() * 3);
          }
        })();
        const outcomes = { applied: 0, failed: 0 };
        try {
          for (let i = 0; i < 150; i++) {
            const outcome = await settled(fencedTransaction(own, lease, (tx) => execute(tx, sql`select 1`)));
            if (outcome === 'resolved') outcomes.applied++;
            else {
              expect(outcome).toBeInstanceOf(PalisadeError);
              outcomes.failed++;
            }
          }
        } finally {
          stop = true;
          await killer;
        }
        expect(outcomes.applied + outcomes.failed).toBe(150);
        // The pool serves again. The killer's last termination may reach the idle session only as the pool
        // lends it to this query, which then fails with it (57P01, CI once): the pool replaces the session.
        expect(await retryEndedSession(() => execute(own, sql`select 1 as one`))).toEqual([{ one: 1 }]);
        await pool.end();
      },
    );

    it('fencedTransaction: the idle timeout closes a transaction left idle, and the holder process lives on', async () => {
      const { db, lease, repo } = await fresh();
      const at = closeAtGate(seen);
      const outcome = at.watch(
        fencedTransaction(
          db,
          lease,
          async (tx) => {
            await repo.with(lease).update({ id: 1 }, { value: 'written' });
            await at.stop(tx);
            await repo.with(lease).update({ id: 1 }, { value: 'again' });
            return 'done';
          },
          { idleTimeoutMs: 50 },
        ),
      );
      // The server ends the session 50 ms after the function went idle; the test waits for the driver to see it.
      await at.close(db, { idle: true });
      expect(await outcome).toBeInstanceOf(DatabaseError);
      await turns();
      expect(await values(db)).toEqual(untouched);
    });
  });
  describe.runIf(needs('DATABASE_URL'))(`${name}: where the connection closes, searched`, () => {
    const shared = testDatabases(open, { shared: true });

    // A step of the function: a write through palisade (joined to the transaction), one of the caller's own
    // through drizzle, a palisade modify (its own savepoint), or a drizzle savepoint around more steps.
    type Step = { kind: 'palisade' | 'drizzle' | 'modify' } | { kind: 'savepoint'; steps: Step[] };
    const leaf = fc.constantFrom<Step>({ kind: 'palisade' }, { kind: 'drizzle' }, { kind: 'modify' });
    const step: fc.Arbitrary<Step> = fc.oneof(
      { weight: 3, arbitrary: leaf },
      {
        weight: 1,
        arbitrary: fc
          .array(leaf, { minLength: 1, maxLength: 3 })
          .map((steps) => ({ kind: 'savepoint', steps }) as Step),
      },
    );
    const leaves = (steps: Step[]): number =>
      steps.reduce((n, s) => n + (s.kind === 'savepoint' ? leaves(s.steps) : 1), 0);
    const program = fc
      .array(step, { minLength: 1, maxLength: 4 })
      .filter((steps) => leaves(steps) <= ROWS)
      .chain((steps) => fc.record({ steps: fc.constant(steps), killAt: fc.integer({ min: 0, max: leaves(steps) }) }));

    // 50 at the full count; npm test runs a fifth of them (test/property/support.ts).
    const runs = propertyRuns(50);
    it('property: wherever the close comes among nested writes and savepoints, the call rejects, every later statement is refused, nothing is visible; without a close every write lands', {
      timeout: Math.max(120_000, runs * 4_000),
    }, async () => {
      await fc.assert(
        fc.asyncProperty(program, async ({ steps, killAt }) => {
          const { db, lease, repo } = await shared();
          const leased = repo.with(lease);
          const total = leaves(steps);
          const at = closeAtGate(seen);
          let n = 0;
          let refused: unknown;
          // Before leaf `killAt` the function stops at the gate and the test closes its connection.
          const run = async (tx: Database, list: Step[]): Promise<void> => {
            for (const s of list) {
              if (s.kind === 'savepoint') {
                await tx.transaction((inner) => run(inner as unknown as Database, s.steps));
                continue;
              }
              const row = ++n;
              if (row - 1 === killAt) await at.stop(tx);
              const value = `v${row}`;
              const write =
                s.kind === 'palisade'
                  ? leased.update({ id: row }, { value })
                  : s.kind === 'drizzle'
                    ? tx.execute(sql`update resource set value = ${value} where id = ${row}`)
                    : repo.modify({ id: row }, lease.fence, async () => ({ value }));
              await write.catch((err: unknown) => {
                refused ??= err;
                throw err;
              });
            }
          };
          const outcome = at.watch(fencedTransaction(db, lease, (tx) => run(tx, steps)));
          if (killAt < total) {
            await at.close(db);
            expect(await outcome).toBeInstanceOf(DatabaseError);
            await until(() => refused !== undefined);
            expect(refused).toBeInstanceOf(Error);
            await turns();
            expect(await values(db)).toEqual(untouched);
          } else {
            expect(await outcome).toBe('resolved');
            const written = Array.from({ length: ROWS }, (_, i) => (i < total ? `v${i + 1}` : 'initial'));
            expect(await values(db)).toEqual(written);
          }
          await lease.release();
        }),
        propertyParams({ numRuns: runs }),
      );
    });
  });
}

// postgres.js flushes what it writes from a `setImmediate`, and keeps what it had not flushed when the socket
// closed: those bytes go out ahead of the startup of the connection's next connect, which the server then
// never completes — on a pool of one, every later call waits for good. So nothing may be sent on a
// transaction's connection between a reset and the moment palisade hears it.
describe.runIf(needs('DATABASE_URL'))(
  'postgres.js: a connection reset, and the pool of one connection after it',
  () => {
    const fresh = testDatabases(postgresDatabase);

    /** `run` on a pool of one connection through a proxy that can reset it; then that pool must serve a call. */
    async function throughProxy(
      run: (o: {
        db: Database;
        admin: Database;
        lease: Lease;
        proxy: ReturnType<typeof withholdingProxy>;
        client: postgres.Sql;
      }) => Promise<void>,
      max = 1,
    ) {
      const { db: admin, url, lease } = await fresh();
      const proxy = withholdingProxy(url as string);
      const client = postgres(await proxy.url(), { max, fetch_types: false, onnotice: () => {} });
      try {
        const db = drizzle(client) as unknown as Database;
        await run({ db, admin, lease, proxy, client });
        proxy.release();
        // The pool reconnects for the next call (whose first statement may get the killed session's error:
        // README, "When the connection closes inside a transaction"; a retry goes through).
        const next = () => within(fencedTransaction(db, lease, (tx) => execute(tx, sql`select 1`)));
        let second = await next();
        if (second instanceof DatabaseError) second = await next();
        expect(second).toBe('resolved');
        expect(await values(admin)).toEqual(untouched);
      } finally {
        await client.end({ timeout: 0.1 });
        proxy.close();
      }
    }

    /** Both connections of a pool of two open (one statement on each at once). */
    const bothOpen = (db: Database) =>
      Promise.all([execute(db, sql`select pg_sleep(0.05)`), execute(db, sql`select pg_sleep(0.05)`)]);

    /** `n` statements at once on `db`: each answers within 10 s (the first after a reconnect may get the killed session's error). */
    async function expectAnswers(db: Database, n: number) {
      const answers = await Promise.all(Array.from({ length: n }, () => within(execute(db, sql`select 1`))));
      for (const answer of answers) expect(answer === 'resolved' || answer instanceof Error).toBe(true);
    }

    // The SAVEPOINT is postgres.js's own statement. Unheard, its failure made the function throw and postgres.js
    // send ROLLBACK on the dying connection (found by test/property/killed-connections.test.ts).
    it("reset while a savepoint's own SAVEPOINT statement is in flight: the call rejects; the pool serves the next call", async () => {
      await throughProxy(async ({ db, admin, lease, proxy }) => {
        const leased = fencedRepository(db, resource).with(lease);
        let pid = 0;
        const outcome = settled(
          fencedTransaction(db, lease, async (tx) => {
            await leased.update({ id: 1 }, { value: 'written' });
            pid = await backendPid(tx);
            // The SAVEPOINT's Parse reaches the server, the rest waits: the session waits for its client.
            proxy.state.splitAfterParse = true;
            await tx.transaction((inner) => inner.execute(sql`update resource set value = 'inner' where id = 2`));
          }),
        );
        await untilWaiting(admin, () => pid, 'ClientRead');
        proxy.reset();
        expect(await outcome).toBeInstanceOf(DatabaseError);
      });
    });

    // The reset of an idle connection reports its close only after the turn's `setImmediate`s: palisade waited
    // one of those to hear it, found nothing, and let postgres.js send ROLLBACK (or ROLLBACK TO, or palisade's
    // probe) in the very phase whose bytes the close then stranded.
    const idleShapes: Record<
      string,
      (o: { tx: Database; db: Database; lease: Lease; at: () => Promise<void> }) => Promise<unknown>
    > = {
      'the function throws': async ({ at }) => {
        await at();
        throw new Error('the caller gave up');
      },
      "a drizzle savepoint's function throws": ({ tx, at }) =>
        tx.transaction(async (inner) => {
          await inner.execute(sql`update resource set value = 'inner' where id = 2`);
          await at();
          throw new Error('the caller gave up');
        }),
      "a nested modify's function throws": ({ db, lease, at }) =>
        fencedRepository(db, resource).modify({ id: 2 }, lease.fence, async () => {
          await at();
          throw new Error('the caller gave up');
        }),
      'a caught failure, then the function returns (palisade asks the server before COMMIT)': async ({ tx, at }) => {
        await tx.execute(sql`insert into resource (id, value) values (1, 'duplicate')`).catch(() => {});
        await at();
      },
    };
    for (const [shape, act] of Object.entries(idleShapes)) {
      it(`reset while the transaction is idle, and ${shape} in the same turn: the call rejects; the pool serves the next call`, async () => {
        await throughProxy(async ({ db, lease, proxy }) => {
          const leased = fencedRepository(db, resource).with(lease);
          // The reset's timer first, then the function's, of the same delay: both fire in one timers phase.
          const delay = 100;
          const at = async () => {
            await new Promise((resolve) => setTimeout(resolve, delay - (performance.now() - started)));
          };
          const started = performance.now();
          setTimeout(() => proxy.reset(), delay);
          const outcome = await settled(
            fencedTransaction(db, lease, async (tx) => {
              await leased.update({ id: 1 }, { value: 'written' });
              await act({ tx, db, lease, at });
            }),
          );
          expect(outcome).toBeInstanceOf(Error);
        });
      });
    }

    // Its lease's signal aborted in the turn of the reset (an advisory lease's own session reset with it does
    // that): palisade's ROLLBACK AND CHAIN, and the look for a statement to cancel, went out at once.
    it('reset while the transaction is idle, and its lease lost in the same turn: LeaseLostError; the pool serves the next call', async () => {
      await throughProxy(async ({ db, lease, proxy }) => {
        const lost = new AbortController();
        const holder = { fence: lease.fence, lock: lease.lock, signal: lost.signal };
        setTimeout(() => {
          proxy.reset();
          setImmediate(() => lost.abort(new LeaseLostError('L', lease.fence, 'its connection dropped')));
        }, 100);
        const outcome = await settled(
          fencedTransaction(db, holder, async () => {
            await fencedRepository(db, resource).with(holder).update({ id: 1 }, { value: 'written' });
            await sleep(600);
          }),
        );
        expect(outcome).toBeInstanceOf(LeaseLostError);
      });
    });

    // An advisory lease's session on the same pool, reset with the transaction's connection, aborts the lease
    // from its close: palisade's look for a statement to cancel went out on the pool at once, to a connection
    // reset too and not heard closed yet, and stranded it.
    it('reset of a pool that holds an advisory lease and its transaction: LeaseLostError; both connections serve again', async () => {
      await throughProxy(async ({ db, client, proxy }) => {
        const locks = advisoryLockManager({ client, namespace: uniqueNamespace('reset') });
        try {
          await bothOpen(db);
          const lease = await locks.acquire('L', { ttlMs: 60_000 });
          setTimeout(() => proxy.reset(), 150);
          const outcome = await settled(
            fencedTransaction(db, lease, async () => {
              await fencedRepository(db, resource).with(lease).update({ id: 1 }, { value: 'written' });
              await sleep(600);
            }),
          );
          expect(outcome).toBeInstanceOf(LeaseLostError);
          await expectAnswers(db, 2);
          await expectAnswers(db, 2);
        } finally {
          await locks.close();
        }
      }, 2);
    });

    // The call rejected as the close was heard, in the turn of the reset, when the pool's other connection,
    // reset too, was not heard closed yet: a statement the caller sent at once went to it, and stranded it.
    it('reset of a pool of two while a transaction is idle: a caller that sends its next statement at once gets an answer', async () => {
      await throughProxy(async ({ db, lease, proxy }) => {
        await bothOpen(db);
        setTimeout(() => proxy.reset(), 100);
        const outcome = await settled(
          fencedTransaction(db, lease, async () => {
            await fencedRepository(db, resource).with(lease).update({ id: 1 }, { value: 'written' });
            await sleep(600);
          }),
        );
        // Sent at once, in the same turn as the rejection.
        const answers = expectAnswers(db, 2);
        expect(outcome).toBeInstanceOf(DatabaseError);
        await answers;
      }, 2);
    });
  },
);

describe.runIf(needs('DATABASE_URL'))(
  "node-postgres: the lock manager's LISTEN connection, closed by the server",
  () => {
    const fresh = testDatabases(nodePostgresDatabase);
    const listening = async (db: Database, except: number[]) =>
      (
        await execute(
          db,
          sql`select pid from pg_stat_activity where datname = current_database() and query like 'listen %' and pid <> pg_backend_pid()`,
        )
      )
        .map((r) => Number(r.pid))
        .filter((pid) => !except.includes(pid));

    it('the process lives, a waiter still gets the lock, and a new LISTEN opens', async () => {
      const { db, locks, lease: held } = await fresh();
      const waiter = locks.acquire('L', { ttlMs: 60_000, waitMs: 30_000 });
      let first: number[] = [];
      await until(async () => {
        first = await listening(db, []);
        return first.length > 0;
      });
      expect(first).toHaveLength(1);
      await terminate(db, first[0] as number);
      let again: number[] = [];
      await until(async () => {
        again = await listening(db, first);
        return again.length > 0;
      });
      expect(again).toHaveLength(1);
      await held.release();
      const next: Lease = await waiter;
      expect(next.fence).toBeGreaterThan(held.fence);
      await next.release();
      await locks.close();
    });
  },
);
