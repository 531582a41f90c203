/**
 * The eager claim at acquire (`claimRegisters`, README "When each backend
 * claims") on real Redis: the stale holder is refused on every row before
 * the new holder writes anything; a grant that finds a higher fence in the
 * register is given back and the acquire fails with a typed error.
 */
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import { describe, expect, it } from 'vitest';
import type { Database } from '../../src/driver.js';
import {
  CommandTimeoutError,
  FenceSourceError,
  InvalidArgumentError,
  LockScopeError,
  PalisadeError,
} from '../../src/errors.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { Lease } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { postgresDatabase } from '../support/databases.js';
import { scenarioDatabase, uniqueNamespace } from '../support/scenario.js';
import { needs, services } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { outcomeOrStillWaiting } from '../support/still-waiting.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

// A holder that has not noticed it lost the lease (paused): its signal never fired.
const unaware = (lease: Lease) => ({ fence: lease.fence, lock: lease.lock, signal: new AbortController().signal });

/** `fn` with a one-connection postgres.js client on a database of the test's own; both closed after it. */
async function withOneConnection(fn: (client: postgres.Sql) => Promise<void>): Promise<void> {
  const own = await scenarioDatabase();
  const client = postgres(own.url ?? '', { max: 1, onnotice: () => {} });
  try {
    await fn(client);
  } finally {
    await client.end({ timeout: 0 });
    await own.close();
  }
}

async function untilFree(manager: LockManager, name: string): Promise<void> {
  for (let i = 0; i < 200 && (await manager.inspect(name)) !== null; i++) await sleep(20);
  expect(await manager.inspect(name)).toBeNull();
}

describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL'))(
  'claimRegisters: the eager claim at acquire (Redis, epochs in another database)',
  { timeout: 120_000 },
  () => {
    async function withRedis(fn: (ctx: { db: Database; epochs: Database; redis: Redis }) => Promise<void>) {
      const fenced = await scenarioDatabase();
      const epochs = await postgresDatabase();
      const redis = new Redis(services.redis.url as string, { commandTimeout: 2_000, maxRetriesPerRequest: 1 });
      redis.on('error', () => {});
      try {
        await migrate(epochs.db);
        await fenced.db.execute(sql`insert into resource (id, value) values (2, 'initial')`);
        await fn({ db: fenced.db, epochs: epochs.db, redis });
      } finally {
        redis.disconnect();
        await epochs.close();
        await fenced.close();
      }
    }

    it('the stale holder is refused on a row nobody wrote, before the new holder writes anything', async () => {
      await withRedis(async ({ db, epochs, redis }) => {
        const namespace = uniqueNamespace('eager');
        const lazy = redisLockManager({ client: redis, namespace, epochs });
        const eager = redisLockManager({ client: redis, namespace, epochs, claimRegisters: { db } });
        const repo = fencedRepository(db, resource, { scope: 'lock' });
        try {
          const old = await lazy.acquire('L', { ttlMs: 150 });
          expect((await repo.with(unaware(old)).update({ id: 1 }, { value: 'old' })).status).toBe('applied');
          await untilFree(lazy, 'L');
          const fresh = await eager.acquire('L', { ttlMs: 60_000 });
          expect(fresh.fence > old.fence).toBe(true);
          // The new holder has written nothing; the old one is refused on a row it never wrote.
          expect(await repo.with(unaware(old)).update({ id: 2 }, { value: 'stale' })).toEqual({
            status: 'stale',
            currentFence: fresh.fence,
          });
          expect((await repo.get({ id: 2 }))?.value).toBe('initial');
          expect((await repo.with(fresh).update({ id: 2 }, { value: 'fresh' })).status).toBe('applied');
          // A lock handed over to a waiter claims too, before that acquire resolves.
          const waiting = eager.acquire('L', { ttlMs: 60_000, waitMs: 20_000 });
          await sleep(50);
          await fresh.release();
          const next = await waiting;
          expect(await repo.with(unaware(fresh)).update({ id: 1 }, { value: 'stale' })).toEqual({
            status: 'stale',
            currentFence: next.fence,
          });
          await next.release();
        } finally {
          await eager.close();
          await lazy.close();
        }
      });
    });

    it('a grant below the register is released and the acquire fails with FenceSourceError', async () => {
      await withRedis(async ({ db, epochs, redis }) => {
        const namespace = uniqueNamespace('eager');
        const eager = redisLockManager({ client: redis, namespace, epochs, claimRegisters: { db } });
        try {
          const first = await eager.acquire('L', { ttlMs: 60_000 });
          const forged = { ...unaware(first), fence: (first.fence + 1_000_000n) as typeof first.fence };
          expect(await claimLockRegister(db, forged)).toEqual({ status: 'claimed' });
          await first.release();
          await expect(eager.acquire('L', { ttlMs: 60_000, waitMs: 1_000 })).rejects.toBeInstanceOf(FenceSourceError);
          await expect(eager.tryAcquire('L', { ttlMs: 60_000 })).rejects.toMatchObject({ code: 'fence_source' });
          // Given back at once: the lock is free, not held until its TTL.
          expect(await eager.inspect('L')).toBeNull();
        } finally {
          await eager.close();
        }
      });
    });

    // Regression: without epochs the source id was a Redis key of its own; evicted alone (the counter
    // kept), the next manager filed the same counter's fences under a second id, and a paused holder's
    // lock-scoped write to a row the new holder had not written applied.
    it('without epochs a Redis lease has no lock: a lock-scoped repository refuses it, claimRegisters is refused', async () => {
      await withRedis(async ({ db, redis }) => {
        const namespace = uniqueNamespace('no-epochs');
        const locks = redisLockManager({ client: redis, namespace, allowFreshCounter: true });
        const repo = fencedRepository(db, resource, { scope: 'lock' });
        try {
          const lease = await locks.acquire('L', { ttlMs: 60_000 });
          expect(lease.lock).toBeUndefined();
          expect(await redis.exists(`{palisade:${namespace}}:source`)).toBe(0);
          expect(() => repo.with(lease)).toThrow(LockScopeError);
          expect((await repo.get({ id: 2 }))?.value).toBe('initial');
          await lease.release();
        } finally {
          await locks.close();
        }
        expect(() =>
          redisLockManager({ client: redis, namespace, claimRegisters: { db }, allowFreshCounter: true }),
        ).toThrow(InvalidArgumentError);
      });
    });

    it("a claim blocked by another transaction's hold on the register stays within the acquire's wait", async () => {
      await withRedis(async ({ db, epochs, redis }) => {
        const namespace = uniqueNamespace('eager-wait');
        const eager = redisLockManager({ client: redis, namespace, epochs, claimRegisters: { db } });
        const old = await eager.acquire('L', { ttlMs: 60_000 });
        // A holder inside a transaction whose claim shares the register row (as one paused there would):
        // the next grant's claim, which raises it, must wait for that row at most its acquire's waitMs.
        let end = () => {};
        const ended = new Promise<void>((resolve) => {
          end = resolve;
        });
        let holding = () => {};
        const held = new Promise<void>((resolve) => {
          holding = resolve;
        });
        const inside = db.transaction(async (tx) => {
          expect((await claimLockRegister(tx, unaware(old))).status).toBe('claimed');
          holding();
          await ended;
        });
        try {
          await held;
          await old.release();
          expect(await eager.tryAcquire('L', { ttlMs: 60_000 })).toBeNull();
          await expect(eager.acquire('L', { ttlMs: 60_000, waitMs: 300 })).rejects.toMatchObject({
            code: 'lock_unavailable',
          });
          // Given back, not left granted: once the transaction ends, the lock is there to take.
          end();
          await inside;
          const next = await eager.acquire('L', { ttlMs: 60_000, waitMs: 5_000 });
          expect(next.fence > old.fence).toBe(true);
          await next.release();
        } finally {
          end();
          await inside.catch(() => {});
        }
      });
    });

    it('a claim whose database stops answering ends on the client (CommandTimeoutError); the grant is given back', async () => {
      await withRedis(async ({ epochs, redis }) => {
        const namespace = uniqueNamespace('eager-stuck');
        // The claim's database has one connection, busy until the test ends: as a frozen host, nothing answers.
        await withOneConnection(async (stuck) => {
          stuck`select pg_sleep(600)`.execute().catch(() => {});
          const eager = redisLockManager({
            client: redis,
            namespace,
            epochs,
            claimRegisters: { db: drizzle(stuck), commandTimeoutMs: 300 },
          });
          // tryAcquire has no wait to cut it short: it hung here for as long as the connection did.
          await expect(eager.tryAcquire('L', { ttlMs: 60_000 })).rejects.toBeInstanceOf(CommandTimeoutError);
          await expect(eager.acquire('L', { ttlMs: 60_000, waitMs: 2_000 })).rejects.toBeInstanceOf(
            CommandTimeoutError,
          );
          await untilFree(redisLockManager({ client: redis, namespace, epochs }), 'L');
        });
      });
    });

    /**
     * A lock a release hands over to a waiter (acquiring with `options`) whose eager claim then gets no
     * answer: the claim's database has one connection, busy from then on. The claim may wait 10 minutes on
     * the client. Returns what the waiter's acquire settles with; the lock must be free once it has.
     */
    async function handOverToStuckClaim(options: { waitMs: number; signal?: AbortSignal }, then = async () => {}) {
      let outcome: unknown;
      await withRedis(async ({ epochs, redis }) => {
        const namespace = uniqueNamespace('eager-handover');
        await withOneConnection(async (claimDb) => {
          const eager = redisLockManager({
            client: redis,
            namespace,
            epochs,
            claimRegisters: { db: drizzle(claimDb), commandTimeoutMs: 600_000 },
          });
          const holder = await eager.acquire('L', { ttlMs: 60_000 });
          const waiter = eager.acquire('L', { ttlMs: 60_000, ...options });
          await sleep(300); // the waiter is in line, waiting for its turn
          claimDb`select pg_sleep(600)`.execute().catch(() => {}); // from now on no claim is answered
          await holder.release(); // hands the lock over to the waiter, whose claim then waits
          await then();
          outcome = await outcomeOrStillWaiting(waiter);
        });
        await untilFree(redisLockManager({ client: redis, namespace, epochs }), 'L');
      });
      return outcome;
    }

    // Before the handover was cut at the wait's end, the waiter waited as long as the claim did.
    it("a lock handed over to a waiter whose claim gets no answer: the waiter still gives up at its wait's end", async () => {
      expect(await handOverToStuckClaim({ waitMs: 1_500 })).toBeInstanceOf(PalisadeError);
    });

    // The handover's claim ran outside the signal's reach: an aborted waiter stayed until the claim answered,
    // and then got the lease (an attack: 5 of 5 with the claim's database frozen 300 ms).
    it('a lock handed over to a waiter whose claim gets no answer: its signal still ends the wait at once, with no lease', async () => {
      const controller = new AbortController();
      const outcome = await handOverToStuckClaim({ waitMs: 60_000, signal: controller.signal }, async () => {
        await sleep(100);
        controller.abort();
      });
      expect(outcome).toMatchObject({ code: 'lock_unavailable', reason: 'aborted' });
    });

    it('a bad claimRegisters is refused before anything runs', () => {
      const redis = new Redis(services.redis.url as string, { lazyConnect: true });
      const lazyDb = drizzle(postgres('postgres://127.0.0.1:1/none')); // never connects: refused before any query
      try {
        for (const bad of [null, {}, { db: 'postgres://x' }, 42, { db: lazyDb, commandTimeoutMs: 0 }]) {
          expect(() =>
            redisLockManager({ client: redis, namespace: 'n', claimRegisters: bad as never, allowFreshCounter: true }),
          ).toThrow(InvalidArgumentError);
        }
      } finally {
        redis.disconnect();
      }
    });
  },
);
