/**
 * A lock-scoped write or fenced transaction whose holder has a few
 * milliseconds of TTL left (README, "Two scopes of fencing"): palisade
 * bounds the transaction's idle time to them, and when the process is
 * slower than that — a function that runs longer, a busy event loop — the
 * server ends the session. Heard before the COMMIT went out, the call
 * rejects with `LeaseLostError` (the driver's failure as its cause) and
 * nothing it wrote is visible; heard at the COMMIT, the outcome is unknown
 * and the call rejects with the driver's `DatabaseError` (a repro: a link
 * lost while the COMMIT's answer is on its way, the row committed). An
 * error the caller's function throws comes out as thrown. On every driver with a server: postgres.js, a
 * node-postgres pool and a single node-postgres `Client` (whose connection
 * is gone afterwards; README, "Installing"). Rows are read back through a
 * connection of their own: a postgres.js pool may hand the ended session to
 * the next query once more (README, "When the connection closes inside a
 * transaction").
 */
import net from 'node:net';
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { drizzle } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, LeaseLostError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { LeasedRepository } from '../../src/repo/repository-api.js';
import { sessionEnded } from '../../src/server-error.js';
import { everyTransactionDriver, type TestDatabase } from '../support/databases.js';
import { createResource, resource, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

// A holder of a lock no other test uses, with `ms` of TTL left by its estimate; its signal never aborts.
const holder = (ms: number) => ({
  fence: toFence(7n) as Fence,
  lock: Object.freeze({ kind: 'test', source: 'near-expiry', namespace: uniqueNamespace(), name: 'L' }),
  expiresAt: performance.now() + ms,
  signal: new AbortController().signal,
});
// Longer than any bound here: the server ends a session idle for its bound whatever the client does.
const OUTLAST_MS = 150;
const TTL_LEFT_MS = 30;

/** What a call settled with: the result, or the error. */
async function settled<T>(call: () => Promise<T>): Promise<{ ok: T } | { err: unknown }> {
  try {
    return { ok: await call() };
  } catch (err) {
    return { err };
  }
}

// A client of the driver under test on `url`, its own.
const clients: Record<string, (url: string) => Promise<{ db: Database; end: () => void }>> = {
  'postgres.js': async (url) => {
    const client = postgres(url, { max: 1, onnotice: () => {} });
    return { db: drizzle(client) as unknown as Database, end: () => void client.end({ timeout: 1 }) };
  },
  'node-postgres': async (url) => {
    const pool = new pg.Pool({ connectionString: url, max: 1 });
    pool.on('error', () => {});
    return { db: drizzleNodePostgres(pool) as unknown as Database, end: () => void pool.end() };
  },
  'a single node-postgres Client': async (url) => {
    const client = new pg.Client({ connectionString: url });
    client.on('error', () => {});
    await client.connect();
    return { db: drizzleNodePostgres(client) as unknown as Database, end: () => void client.end() };
  },
};

function expectOutlived(outcome: { ok: unknown } | { err: unknown }): void {
  expect(outcome).toHaveProperty('err');
  const { err } = outcome as { err: unknown };
  expect(err).toBeInstanceOf(LeaseLostError);
  expect(err).not.toBeInstanceOf(DatabaseError);
}

describe.runIf(needs('DATABASE_URL')).each(everyTransactionDriver.filter((d) => d.real))(
  'a holder whose TTL runs out inside its transaction, on $name',
  ({ name, open }) => {
    const connect = clients[name] as (typeof clients)[string];
    // A database per call: a single Client's connection does not come back once its session was ended.
    const opened: TestDatabase[] = [];
    let reader: postgres.Sql | undefined;
    let row = 0;
    beforeAll(() => {
      row = 0;
    });
    afterAll(async () => {
      await reader?.end({ timeout: 1 });
      await Promise.all(opened.map((t) => t.close()));
    });
    async function fresh(): Promise<{ db: Database; url: string; valueAt: (id: number) => Promise<unknown> }> {
      const t = await open({ migrated: true });
      opened.push(t);
      await migrate(t.db);
      await createResource(t.db, 200);
      const own = postgres(t.url as string, { max: 1, onnotice: () => {} });
      const read = drizzle(own) as unknown as Database;
      await reader?.end({ timeout: 1 });
      reader = own;
      return {
        db: t.db,
        url: t.url as string,
        valueAt: async (id) => (await execute(read, sql`select value from resource where id = ${id}`))[0]?.value,
      };
    }

    it('a lock-scoped modify whose function outlasts the TTL left: LeaseLostError, and the patch is not written', async () => {
      const { db, valueAt } = await fresh();
      const id = ++row;
      const outcome = await settled(() =>
        fencedRepository(db, resource)
          .with(holder(TTL_LEFT_MS))
          .modify({ id }, async () => {
            await sleep(OUTLAST_MS);
            return { value: 'late' };
          }),
      );
      expectOutlived(outcome);
      expect(await valueAt(id)).toBe('initial');
    });

    it('a fenced transaction whose function outlasts the TTL left: LeaseLostError, and nothing it wrote is visible', async () => {
      const { db, valueAt } = await fresh();
      const [a, b] = [++row, ++row];
      const repo = fencedRepository(db, resource);
      const lease = holder(TTL_LEFT_MS);
      const outcome = await settled(() =>
        fencedTransaction(db, lease, async () => {
          await repo.with(lease).update({ id: a }, { value: 'early' });
          await sleep(OUTLAST_MS);
          // The session is gone: this statement is what hears it.
          await repo.with(lease).update({ id: b }, { value: 'late' });
        }),
      );
      expectOutlived(outcome);
      expect([await valueAt(a), await valueAt(b)]).toEqual(['initial', 'initial']);
    });

    // The second write: a statement of its own (update), or one that opens a claim of its own first (inClaim,
    // which reads the register instead once the TTL ran out — here on the session the bound ended).
    const afterBound: Record<string, (repo: LeasedRepository<typeof resource>, id: number) => Promise<unknown>> = {
      update: (repo, id) => repo.update({ id }, { value: 'late' }),
      upsert: (repo, id) => repo.upsert({ id, value: 'late' }),
      modify: (repo, id) => repo.modify({ id }, () => ({ value: 'late' })),
      updateWhere: (repo, id) => repo.updateWhere(sql`id = ${id}`, { value: 'late' }),
    };
    for (const [kind, secondWrite] of Object.entries(afterBound))
      it(`in a transaction opened for something else: the ${kind} after the bound ended the session is LeaseLostError`, async () => {
        // On a machine busy enough for the TTL left to run out before the first write, that write is refused
        // before it bounds anything: the scenario is tried again, at most 5 times — on a database of its own
        // each time (a single Client's session, once ended, does not come back).
        for (let attempt = 1; ; attempt++) {
          const { db, valueAt } = await fresh();
          const [a, b, c] = [++row, ++row, ++row];
          const lease = holder(TTL_LEFT_MS);
          let first: { ok: unknown } | { err: unknown } = { ok: 'not reached' };
          let second: { ok: unknown } | { err: unknown } = { ok: 'not reached' };
          let called = false;
          let fnDone = () => {};
          const done = new Promise<void>((resolve) => {
            fnDone = resolve;
          });
          // A row-scoped modify's transaction: palisade's, whose connection closing the process survives on every
          // driver ("When the connection closes inside a transaction"; one of your own on postgres.js would end it).
          const outer = await settled(() =>
            fencedRepository(db, resource).modify({ id: c }, toFence(1n) as Fence, async (_row, tx) => {
              called = true;
              try {
                const repo = fencedRepository(tx, resource).with(lease);
                // Bounds the transaction to the TTL left, then writes.
                first = await settled(() => repo.update({ id: a }, { value: 'early' }));
                if ('err' in first) return { value: 'outer' };
                await sleep(OUTLAST_MS);
                second = await settled(() => secondWrite(repo, b));
                return { value: 'outer' };
              } finally {
                fnDone();
              }
            }),
          );
          // On postgres.js the outer call rejects as soon as the close is seen, while the function still sleeps.
          if (called) await done;
          if ((!called || 'err' in first) && attempt < 5) continue;
          expect(called).toBe(true);
          expect(first).toHaveProperty('ok');
          expectOutlived(second);
          expect(outer).toHaveProperty('err');
          expect([await valueAt(a), await valueAt(b), await valueAt(c)]).toEqual(['initial', 'initial', 'initial']);
          return;
        }
      });

    it("an error the caller's function throws comes out as thrown, its TTL run out or not, however it reads", async () => {
      const { db, valueAt } = await fresh();
      const thrown = [
        Object.assign(new Error('an HTTP call failed'), { code: 'ECONNRESET' }),
        Object.assign(new Error('another database went away'), { code: '57P01' }),
        new Error('Connection terminated unexpectedly'),
      ];
      for (const err of thrown) {
        const id = ++row;
        // The session stays busy (not idle) past the TTL: the bound does not end it. Once it is idle again the
        // bound (the 200 ms that were left) gives the function that long to throw — a busy machine's client can
        // take longer than the 30 ms of the other tests, and a session the bound ended first is LeaseLostError.
        const outlast = async (tx: Database) => {
          await execute(tx, sql`select pg_sleep(0.35)`);
          throw err;
        };
        // A holder whose TTL ran out before the call started (a busy machine) is refused before its function
        // runs, and one whose client took longer than the bound to throw finds its session ended by it
        // (LeaseLostError, as designed): the call is made again with a new holder, at most 5 times.
        const call = async (run: (lease: ReturnType<typeof holder>) => Promise<unknown>) => {
          for (let attempt = 1; ; attempt++) {
            const outcome = await settled(() => run(holder(200)));
            const slow =
              'err' in outcome &&
              outcome.err instanceof LeaseLostError &&
              /before|idle bound ended the session/.test(outcome.err.message);
            if (!slow || attempt === 5) return outcome;
          }
        };
        const modified = await call((lease) =>
          fencedRepository(db, resource)
            .with(lease)
            .modify({ id }, async (_row, tx) => outlast(tx)),
        );
        expect(modified as object).toEqual({ err });
        expect((await call((lease) => fencedTransaction(db, lease, outlast))) as object).toEqual({ err });
        expect(await valueAt(id)).toBe('initial');
      }
    });

    it("a session lost while the COMMIT's answer is on its way: a DatabaseError (outcome unknown), not LeaseLostError — here it committed", async () => {
      const { url, valueAt } = await fresh();
      // A loopback proxy: once armed, it forwards a COMMIT, withholds the server's answer 200 ms, then drops
      // the link; the holder's TTL runs out meanwhile.
      let armed = false;
      // Whether the server answered a COMMIT the proxy forwarded (its CommandComplete, withheld from the client).
      let serverCommitted = false;
      let loseLease = () => {};
      const proxy = net.createServer((client) => {
        const server = net.connect(new URL(url).port ? Number(new URL(url).port) : 5432, new URL(url).hostname);
        let committed = false;
        client.on('error', () => {});
        server.on('error', () => {});
        client.on('data', (d) => {
          if (armed && /commit\0/i.test(d.toString('latin1'))) {
            committed = true;
            // The lease is lost while the COMMIT is on its way: that does not make the outcome known.
            loseLease();
          }
          server.write(d);
        });
        server.on('data', (d) => {
          if (!committed) client.write(d);
          else {
            if (d.toString('latin1').includes('COMMIT\0')) serverCommitted = true;
            setTimeout(() => client.destroy(), 200);
          }
        });
        client.on('close', () => server.destroy());
        server.on('close', () => client.destroy());
      });
      await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve));
      const proxied = new URL(url);
      proxied.host = `127.0.0.1:${(proxy.address() as net.AddressInfo).port}`;
      try {
        for (const write of ['modify', 'upsert', 'fenced'] as const) {
          // A loaded machine can let the 80 ms run out before the COMMIT reaches the server (the call rejects
          // before it, or the idle bound ended the session first): then nothing is written, and the trial is
          // made again (at most 5 times).
          for (let attempt = 1; ; attempt++) {
            const own = await connect(proxied.toString());
            const id = ++row;
            await execute(own.db, sql`select 1`);
            const signal = new AbortController();
            loseLease = () => signal.abort(new Error('the lease was lost'));
            const lease = { ...holder(80), signal: signal.signal };
            const repo = fencedRepository(own.db, resource).with(lease);
            serverCommitted = false;
            armed = true;
            const outcome = await settled(
              (): Promise<unknown> =>
                write === 'modify'
                  ? repo.modify({ id }, () => ({ value: 'written' }))
                  : write === 'upsert'
                    ? repo.upsert({ id, value: 'written' })
                    : fencedTransaction(own.db, lease, () => repo.update({ id }, { value: 'written' })),
            );
            armed = false;
            own.end();
            if (!serverCommitted && attempt < 5) {
              expect(outcome).toHaveProperty('err');
              expect([write, await valueAt(id)]).toEqual([write, 'initial']);
              continue;
            }
            expect([write, attempt, serverCommitted]).toEqual([write, attempt, true]);
            expect([write, await valueAt(id)]).toEqual([write, 'written']);
            expect(outcome).toHaveProperty('err');
            expect((outcome as { err: unknown }).err).toBeInstanceOf(DatabaseError);
            expect((outcome as { err: DatabaseError }).err.outcomeUnknown).toBe(true);
            break;
          }
        }
      } finally {
        armed = false;
        proxy.close();
      }
    });

    it('with the event loop busy in 3 ms slices and 4 ms left: applied, LeaseLostError with nothing written, or a closed session at the COMMIT', async () => {
      type Call = (db: Database, id: number) => Promise<unknown>;
      const calls: Call[] = [
        (db, id) =>
          fencedRepository(db, resource)
            .with(holder(4))
            .modify({ id }, () => ({ value: 'late' })),
        (db, id) => fencedRepository(db, resource).with(holder(4)).upsert({ id, value: 'late' }),
        (db, id) =>
          fencedTransaction(db, holder(4), () =>
            fencedRepository(db, resource).update({ id }, 7n as Fence, { value: 'late' }),
          ),
      ];
      const outcomes: string[] = [];
      for (const call of [...calls, ...calls]) {
        // A database each: a single Client whose session ended answers nothing more.
        const { db, valueAt } = await fresh();
        const id = ++row;
        const busy = setInterval(() => {
          const from = performance.now();
          while (performance.now() - from < 3) {}
        }, 1);
        let outcome: { ok: unknown } | { err: unknown };
        try {
          outcome = await settled(() => call(db, id));
        } finally {
          clearInterval(busy);
        }
        const value = await valueAt(id);
        if ('ok' in outcome) {
          outcomes.push('applied');
          expect(value).toBe('late');
        } else if (outcome.err instanceof LeaseLostError) {
          outcomes.push('LeaseLostError');
          expect(value).toBe('initial');
        } else {
          // Heard at the COMMIT: the outcome is unknown, and the error says the session ended.
          outcomes.push('unknown');
          expect(outcome.err).toBeInstanceOf(DatabaseError);
          expect(sessionEnded(outcome.err)).toBe(true);
          expect(['initial', 'late']).toContain(value);
        }
      }
      expect(outcomes).toHaveLength(6);
    });
  },
);
