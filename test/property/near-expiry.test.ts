/**
 * Holders with a few milliseconds of TTL left (README, "Two scopes of
 * fencing"), searched on a REAL Postgres: every kind of lock-scoped write
 * and a fenced transaction, by a holder with 1–8 ms left, the event loop
 * busy in slices of 0–5 ms, the holder's function (a modify's, a fenced
 * transaction's) busy for 0–10 ms, sometimes a higher fence that
 * claimed the lock first, and sometimes one that claims it 0–12 ms into
 * the call, in a transaction of its own. Whether the idle bound of the TTL left ends the
 * session is up to the timing; whatever it does, the outcome is the
 * write's status (`applied`, its row changed; `stale`, unchanged, and only
 * where a higher fence claimed), `LeaseLostError` with the row unchanged, or
 * — heard at the COMMIT, outcome unknown — a `DatabaseError` that says the
 * session ended; never another error. And a write that applied committed
 * before the concurrent higher fence's claim did: each transaction notes
 * its commit in a sequence, from a deferred trigger (at its COMMIT, with
 * its locks still held). On postgres.js and a node-postgres pool, a pool of
 * its own per run: a postgres.js pool may hand a session the server ended to
 * one more query, which then fails (README, "When the connection closes
 * inside a transaction"), and that query would be the next run's. A single
 * node-postgres `Client`, whose connection does not come back, has the
 * example tests of test/repo/near-expiry.test.ts.
 */
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { drizzle } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError, LeaseLostError } from '../../src/errors.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { sessionEnded } from '../../src/server-error.js';
import { everyTransactionDriver, type TestDatabase } from '../support/databases.js';
import { createResource, resource, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const FENCE = toFence(7n) as Fence;

type Kind = 'update' | 'delete' | 'upsert' | 'modify' | 'updateWhere' | 'fenced';
interface Case {
  readonly kind: Kind;
  readonly ttlLeftMs: number;
  /** The event loop spins this long every 1 ms while the call runs (0: not busy). */
  readonly sliceMs: number;
  /** A modify's or fenced transaction's function spins this long. */
  readonly fnMs: number;
  /** A higher fence claimed the lock first. */
  readonly rival: boolean;
  /** A higher fence claims the lock this many ms into the call, in a transaction of its own (null: none). */
  readonly rivalAtMs: number | null;
  /** The holder's pool has its connection open before the call. */
  readonly warm: boolean;
}
const cases = fc.record<Case>({
  kind: fc.constantFrom<Kind>('update', 'delete', 'upsert', 'modify', 'updateWhere', 'fenced'),
  ttlLeftMs: fc.integer({ min: 1, max: 8 }),
  sliceMs: fc.constantFrom(0, 1, 2, 3, 5),
  fnMs: fc.constantFrom(0, 2, 5, 10),
  rival: fc.boolean(),
  rivalAtMs: fc.option(fc.integer({ min: 0, max: 12 }), { freq: 2 }),
  warm: fc.boolean(),
});

const spin = (ms: number) => {
  const from = performance.now();
  while (performance.now() - from < ms) {}
};

// A pool of its own, on the database at `url`.
const pools = {
  'postgres.js': (url: string) => {
    const client = postgres(url, { max: 4, onnotice: () => {} });
    return { db: drizzle(client) as unknown as Database, end: () => client.end({ timeout: 1 }) };
  },
  'node-postgres': (url: string) => {
    const pool = new pg.Pool({ connectionString: url, max: 4 });
    pool.on('error', () => {}); // an idle connection the server ended
    return { db: drizzleNodePostgres(pool) as unknown as Database, end: () => pool.end() };
  },
};
const drivers = everyTransactionDriver.filter((d) => d.name === 'postgres.js' || d.name === 'node-postgres');

describe.runIf(needs('DATABASE_URL')).each(drivers)('a holder with a few ms left, on $name', ({ name, open }) => {
  let test_: TestDatabase;
  let db: Database;
  let reader: postgres.Sql;
  let read: Database;
  let row = 0;
  beforeAll(async () => {
    test_ = await open({ migrated: true });
    db = test_.db;
    await migrate(db);
    await createResource(db, 2000);
    // Each transaction that writes a row of `resource` (the holder) or of `marks` (the concurrent rival)
    // notes it in `commits` at its COMMIT: the order of `seq` is the order in which they committed.
    await execute(
      db,
      sql.raw(`create table marks (id int primary key);
        create table commits (seq bigserial primary key, who text not null, id int not null);
        create function note_commit() returns trigger language plpgsql as $$
          begin insert into commits (who, id) values (TG_ARGV[0], coalesce(new.id, old.id)); return null; end $$;
        create constraint trigger holder_commit after insert or update or delete on resource
          deferrable initially deferred for each row execute function note_commit('holder');
        create constraint trigger rival_commit after insert on marks
          deferrable initially deferred for each row execute function note_commit('rival')`),
    );
    // Rows are read back on a connection of their own (see the header of test/repo/near-expiry.test.ts).
    reader = postgres(test_.url as string, { max: 1, onnotice: () => {} });
    read = drizzle(reader) as unknown as Database;
  }, 120_000);
  afterAll(async () => {
    await reader?.end({ timeout: 1 });
    await test_?.close();
  });
  const commitOf = async (who: string, id: number) =>
    (await execute(read, sql`select seq::int8::text as seq from commits where who = ${who} and id = ${id}`))[0]?.seq;
  const valueAt = async (id: number) =>
    (await execute(read, sql`select value, deleted_at is not null as deleted from resource where id = ${id}`))[0];

  test.prop([cases], propertyParams({ numRuns: propertyRuns(80) }))(
    'every call is its status or LeaseLostError, and a LeaseLostError wrote nothing',
    async (c) => {
      const id = ++row;
      const lock = Object.freeze({ kind: 'test', source: 'near-expiry', namespace: uniqueNamespace(), name: 'L' });
      if (c.rival) {
        const higher = { fence: toFence(9n) as Fence, lock, signal: new AbortController().signal };
        await claimLockRegister(db, higher);
      }
      const own = pools[name as keyof typeof pools](test_.url as string);
      // A connection already open, or one the call opens (its TTL left then often runs out meanwhile).
      if (c.warm) await execute(own.db, sql`select 1`);
      const holder = {
        fence: FENCE,
        lock,
        expiresAt: performance.now() + c.ttlLeftMs,
        signal: new AbortController().signal,
      };
      const repo = fencedRepository(own.db, resource);
      const calls: Record<Kind, () => Promise<unknown>> = {
        update: () => repo.with(holder).update({ id }, { value: 'late' }),
        delete: () => repo.with(holder).delete({ id }),
        upsert: () => repo.with(holder).upsert({ id, value: 'late' }),
        modify: () =>
          repo.with(holder).modify({ id }, () => {
            spin(c.fnMs);
            return { value: 'late' };
          }),
        updateWhere: () => repo.with(holder).updateWhere(sql`id = ${id}`, { value: 'late' }),
        fenced: () =>
          fencedTransaction(own.db, holder, async () => {
            spin(c.fnMs);
            return repo.with(holder).update({ id }, { value: 'late' });
          }),
      };
      const busy = c.sliceMs > 0 ? setInterval(() => spin(c.sliceMs), 1) : undefined;
      // The concurrent rival: claims the lock at a higher fence, then marks its commit.
      const rival = new Promise<unknown>((resolve) => {
        if (c.rivalAtMs === null) return resolve(undefined);
        const higher = { fence: toFence(11n) as Fence, lock, signal: new AbortController().signal };
        setTimeout(() => {
          fencedTransaction(db, higher, (tx) => execute(tx, sql`insert into marks (id) values (${id})`)).then(
            resolve,
            resolve,
          );
        }, c.rivalAtMs);
      });
      let outcome: { ok: unknown } | { err: unknown };
      try {
        outcome = { ok: await calls[c.kind]() };
      } catch (err) {
        outcome = { err };
      } finally {
        await rival;
        clearInterval(busy);
        // Not waited for: postgres.js takes up to its timeout over a connection the server closed.
        own.end().catch(() => {});
      }
      const after = await valueAt(id);
      const unchanged = after?.value === 'initial' && after?.deleted === false;
      if ('err' in outcome) {
        if (outcome.err instanceof LeaseLostError) {
          expect(unchanged).toBe(true);
          return;
        }
        // Heard at the COMMIT: the outcome is unknown, and the error says the session ended.
        expect(outcome.err).toBeInstanceOf(DatabaseError);
        expect(sessionEnded(outcome.err)).toBe(true);
        expect(c.kind === 'delete' ? true : unchanged || after?.value === 'late').toBe(true);
        return;
      }
      // The status: a fenced transaction's, or that of the write it ran.
      const result = outcome.ok as { status: string; value?: { status: string } };
      const status = c.kind === 'fenced' && result.status === 'applied' ? result.value?.status : result.status;
      const applied =
        c.kind === 'updateWhere' ? (result as unknown as { applied: number }).applied === 1 : status === 'applied';
      const rivalCommit = await commitOf('rival', id);
      if (applied) {
        expect(c.rival).toBe(false);
        expect(c.kind === 'delete' ? after?.deleted : after?.value === 'late').toBe(true);
        // Before the concurrent higher fence's claim committed, if it did.
        const holderCommit = await commitOf('holder', id);
        expect(holderCommit).toBeDefined();
        if (rivalCommit !== undefined) expect(BigInt(String(holderCommit)) < BigInt(String(rivalCommit))).toBe(true);
      } else {
        // Stale: a higher fence claimed first — before the call, or concurrently, and committed.
        expect(c.rival || rivalCommit !== undefined).toBe(true);
        expect(unchanged).toBe(true);
      }
    },
    propertyTimeout(200_000),
  );
});
