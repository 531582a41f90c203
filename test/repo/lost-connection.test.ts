/**
 * A transaction whose connection the server closed (README, "When the
 * connection closes inside a transaction"): on postgres.js, sending anything
 * more on it would end the process (an uncatchable error of the driver), so
 * palisade sends nothing: the call rejects with the close, the function's
 * later writes through palisade reject without a query, and nothing the
 * transaction wrote is visible. The function is held at a gate until the
 * call has rejected, so the close is processed before it goes on — in every
 * run, not by luck of timing.
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { describe, expect, it } from 'vitest';
import { execute } from '../../src/driver.js';
import { DatabaseError, PalisadeError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { toFence } from '../../src/fencing/fence.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { LeasedRepository } from '../../src/repo/repository-api.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { scenarioDatabase, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

type Database = Awaited<ReturnType<typeof scenarioDatabase>>['db'];

function gate() {
  let open = () => {};
  const opened = new Promise<void>((resolve) => {
    open = resolve;
  });
  return { open, opened };
}

/** Ends one backend from another session, as an operator or a failover would. */
async function terminate(db: Database, pid: number) {
  await execute(db, sql`select pg_terminate_backend(${pid})`);
}

// What the function does once its connection is gone.
const afterClose: Record<string, (leased: LeasedRepository<typeof resource>, tx: Database) => Promise<string>> = {
  'writes through palisade': async (leased) => {
    await leased.update({ id: 2 }, { value: 'late' });
    return 'wrote';
  },
  'writes through drizzle itself': async (_leased, tx) => {
    await tx.execute(sql`update resource set value = 'late' where id = 2`);
    return 'wrote';
  },
  'opens a savepoint through drizzle': async (_leased, tx) => {
    await tx.transaction(async (inner) => inner.execute(sql`update resource set value = 'late' where id = 2`));
    return 'wrote';
  },
  throws: async () => {
    throw new Error('the function gave up');
  },
  returns: async () => 'done',
};

describe.runIf(needs('DATABASE_URL'))('a transaction whose connection the server closed (postgres.js)', () => {
  for (const [what, act] of Object.entries(afterClose)) {
    it(`fencedTransaction: closed by pg_terminate_backend, then the function ${what}: the call rejects, the process lives, nothing is visible`, async () => {
      const scenario = await scenarioDatabase();
      try {
        const { db } = scenario;
        await execute(db, sql`insert into resource (id, value) values (2, 'initial')`);
        const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('lost') });
        const lease = await locks.acquire('L', { ttlMs: 60_000 });
        const repo = fencedRepository(db, resource);
        const inside = gate();
        const resume = gate();
        let pid = 0;
        const call = fencedTransaction(db, lease, async (tx) => {
          const written = await repo.with(lease).update({ id: 1 }, { value: 'written' });
          expect(written.status).toBe('applied');
          const [row] = await execute(tx, sql`select pg_backend_pid() as pid`);
          pid = Number(row?.pid);
          inside.open();
          await resume.opened;
          return act(repo.with(lease), tx);
        });
        const outcome = call.then(
          () => undefined,
          (err: unknown) => err,
        );
        await inside.opened;
        await terminate(db, pid);
        const err = await outcome;
        expect(err).toBeInstanceOf(DatabaseError);
        expect((err as DatabaseError).message).toMatch(/CONNECTION_CLOSED/);
        resume.open();
        // Had anything been sent on the closed connection, the driver's error would end this process
        // within these turns of the event loop.
        for (let i = 0; i < 5; i++) await new Promise((r) => setTimeout(r, 10));
        expect((await repo.get({ id: 1 }))?.value).toBe('initial');
        expect((await repo.get({ id: 2 }))?.value).toBe('initial');
        // The pool has connections to give again, and the lock's next grant goes through.
        await lease.release();
        const next = await locks.acquire('L', { ttlMs: 60_000, waitMs: 10_000 });
        expect((await repo.with(next).update({ id: 1 }, { value: 'next' })).status).toBe('applied');
        await next.release();
      } finally {
        await scenario.close();
      }
    });
  }

  it('a write through palisade after the close rejects with a PalisadeError and sends nothing', async () => {
    const scenario = await scenarioDatabase();
    try {
      const { db } = scenario;
      const repo = fencedRepository(db, resource);
      const inside = gate();
      const resume = gate();
      let pid = 0;
      let late: unknown;
      const call = repo.modify({ id: 1 }, toFence(5n), async (_row, tx) => {
        const [row] = await execute(tx, sql`select pg_backend_pid() as pid`);
        pid = Number(row?.pid);
        inside.open();
        await resume.opened;
        late = await execute(tx, sql`select 1`).then(
          () => 'sent',
          (err: unknown) => err,
        );
        return { value: 'modified' };
      });
      const outcome = call.then(
        () => undefined,
        (err: unknown) => err,
      );
      await inside.opened;
      await terminate(db, pid);
      expect(await outcome).toBeInstanceOf(DatabaseError);
      resume.open();
      for (let i = 0; i < 50 && late === undefined; i++) await new Promise((r) => setTimeout(r, 10));
      expect(late).toBeInstanceOf(PalisadeError);
      expect((late as PalisadeError).code).toBe('database');
      expect((late as Error).message).toMatch(/connection was closed/);
      expect((await repo.get({ id: 1 }))?.value).toBe('initial');
    } finally {
      await scenario.close();
    }
  });

  it('fencedTransaction: the idle timeout closes a transaction left idle, and the holder process lives on', async () => {
    const scenario = await scenarioDatabase();
    try {
      const { db } = scenario;
      const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('idle') });
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      const repo = fencedRepository(db, resource);
      const resume = gate();
      const call = fencedTransaction(
        db,
        lease,
        async () => {
          await repo.with(lease).update({ id: 1 }, { value: 'written' });
          await resume.opened;
          await repo.with(lease).update({ id: 1 }, { value: 'again' });
          return 'done';
        },
        { idleTimeoutMs: 50 },
      );
      const err = await call.then(
        () => undefined,
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(DatabaseError);
      resume.open();
      for (let i = 0; i < 5; i++) await new Promise((r) => setTimeout(r, 10));
      expect((await repo.get({ id: 1 }))?.value).toBe('initial');
      await lease.release();
    } finally {
      await scenario.close();
    }
  });
});
