/**
 * What every lock manager gets from `createLockManager`, whatever the
 * backend: events, the watchdog's `maxHoldMs`, and a wait that a signal or
 * `waitMs` ends. Run on the Postgres lease backend over embedded PGlite, so
 * it needs no server.
 */
import { AsyncLocalStorage } from 'node:async_hooks';
import type { PGlite } from '@electric-sql/pglite';
import { drizzle } from 'drizzle-orm/pglite';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Database } from '../../src/driver.js';
import { LeaseLostError, LockUnavailableError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import type { LockEvents } from '../../src/fencing/events.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { newPglite } from '../support/pglite.js';
import { uniqueNamespace } from '../support/scenario.js';

/** Resolves with the signal's reason once it aborts (bounded by the test's timeout). */
function aborted(signal: AbortSignal): Promise<unknown> {
  return new Promise((resolve) => {
    if (signal.aborted) resolve(signal.reason);
    else signal.addEventListener('abort', () => resolve(signal.reason), { once: true });
  });
}

describe('createLockManager (on the Postgres lease backend, PGlite)', () => {
  let client: PGlite;
  let db: Database;
  let manager: LockManager;

  beforeAll(async () => {
    client = newPglite();
    db = drizzle(client) as unknown as Database;
    await migrate(db);
  });
  afterAll(async () => {
    await client?.close();
  });

  function fresh(): LockManager {
    manager = postgresLockManager({ client: db, namespace: uniqueNamespace('lm'), listen: false });
    return manager;
  }

  it("a lease's TTL running out is seen in the async context of the request that took it", async () => {
    const locks = fresh();
    const request = new AsyncLocalStorage<string>();
    const seen: string[] = [];
    locks.events.on('lost', (event) => seen.push(`lost ${event.name} in ${request.getStore()}`));
    const take = (id: string, ttlMs: number) =>
      request.run(id, async () => {
        const lease = await locks.acquire(`ctx-${id}`, { ttlMs });
        lease.signal.addEventListener('abort', () => seen.push(`abort ctx-${id} in ${request.getStore()}`));
        return lease;
      });
    // B's deadline is the earlier one: the local deadlines' shared timer is armed anew inside B's request.
    const a = await take('A', 400);
    const b = await take('B', 150);
    await Promise.all([aborted(a.signal), aborted(b.signal)]);
    expect(seen.sort()).toEqual(['abort ctx-A in A', 'abort ctx-B in B', 'lost ctx-A in A', 'lost ctx-B in B']);
  });

  it('reports acquired, extended, released and lost, with the lease they are about', async () => {
    const locks = fresh();
    const seen: { type: keyof LockEvents; event: LockEvents[keyof LockEvents] }[] = [];
    for (const type of ['acquired', 'extended', 'released', 'lost'] as const) {
      locks.events.on(type, (event) => seen.push({ type, event }));
    }

    const lease = await locks.acquire('job', { ttlMs: 10_000, holder: 'worker-1' });
    await lease.extend(20_000);
    expect(await lease.release()).toBe('released');
    const short = await locks.acquire('job', { ttlMs: 100 });
    await aborted(short.signal); // nobody extends it: the local deadline passes

    expect(seen.map((s) => s.type)).toEqual(['acquired', 'extended', 'released', 'acquired', 'lost']);
    expect(seen[0]?.event).toMatchObject({ name: 'job', fence: lease.fence, holder: 'worker-1' });
    const acquired = seen[0]?.event as LockEvents['acquired'] | undefined;
    expect(acquired?.waitedMs).toBeGreaterThanOrEqual(0);
    expect(seen[1]?.event).toEqual({ name: 'job', fence: lease.fence, ttlMs: 20_000 });
    expect(seen[2]?.event).toEqual({ name: 'job', fence: lease.fence, wasHeld: true });
    expect(seen[4]?.event).toMatchObject({
      name: 'job',
      fence: short.fence,
      reason: expect.stringMatching(/TTL ran out/),
    });
    await short.release();
    await locks.close();
  });

  it('autoExtend keeps a lease past its TTL, and stops at maxHoldMs so the lease then runs out', async () => {
    const locks = fresh();
    let extensions = 0;
    locks.events.on('extended', () => extensions++);

    const lease = await locks.acquire('stuck-job', { ttlMs: 1500, autoExtend: true, maxHoldMs: 3000 });
    const reason = await aborted(lease.signal);

    // It was extended (so it outlived one TTL), then the watchdog gave up and the TTL ran out.
    expect(extensions).toBeGreaterThanOrEqual(1);
    expect(reason).toBeInstanceOf(LeaseLostError);
    expect((reason as Error).message).toMatch(/TTL ran out without a confirmed extension/);
    const next = await locks.acquire('stuck-job', { ttlMs: 1000, waitMs: 10_000 });
    expect(next.fence).toBeGreaterThan(lease.fence);
    await next.release();
    await lease.release();
    await locks.close();
  });

  // Found by an attack: the server applies a shorter TTL before its reply arrives, and the lease kept
  // believing the longer one in between (or took it back from an earlier extension's later reply).
  it("a shorter extension lowers the lease's expiry as it is sent; an earlier, longer one answered after never raises it", async () => {
    const locks = fresh();
    const lease = await locks.acquire('shrink', { ttlMs: 60_000 });
    const longer = lease.extend(30_000);
    const shorter = lease.extend(5_000);
    await longer;
    expect(lease.expiresAt).toBeLessThanOrEqual(performance.now() + 5_000);
    await shorter;
    expect(lease.expiresAt).toBeGreaterThan(performance.now());
    expect(lease.signal.aborted).toBe(false);
    expect(await lease.release()).toBe('released');
    await locks.close();
  });

  it('a wait ends with LockUnavailableError: reason timeout after waitMs, reason aborted on the signal', async () => {
    const locks = fresh();
    const held = await locks.acquire('busy', { ttlMs: 60_000 });

    const timedOut = await locks.acquire('busy', { ttlMs: 1000, waitMs: 50 }).catch((e: unknown) => e);
    expect(timedOut).toBeInstanceOf(LockUnavailableError);
    expect(timedOut).toMatchObject({ code: 'lock_unavailable', lockName: 'busy', reason: 'timeout' });

    const controller = new AbortController();
    const waiting = locks
      .acquire('busy', { ttlMs: 1000, waitMs: 60_000, signal: controller.signal })
      .catch((e: unknown) => e);
    controller.abort();
    expect(await waiting).toMatchObject({ code: 'lock_unavailable', reason: 'aborted' });

    expect(await locks.tryAcquire('busy', { ttlMs: 1000 })).toBeNull();
    await held.release();
    await locks.close();
  });
});

/**
 * `using()` when the release itself fails — here for real: the callback
 * closes the database the lease lives in, so the release statement cannot
 * run. The callback's own outcome must come out, not the release's error;
 * the failed release is reported as a `lost` event (the lock frees at its
 * TTL).
 */
describe('using() when release fails (PGlite closed under the lease)', () => {
  async function closingManager(): Promise<{ locks: LockManager; client: PGlite; lost: LockEvents['lost'][] }> {
    const client = newPglite();
    const db = drizzle(client) as unknown as Database;
    await migrate(db);
    const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('using'), listen: false });
    const lost: LockEvents['lost'][] = [];
    locks.events.on('lost', (event) => lost.push(event));
    return { locks, client, lost };
  }

  it("a callback that succeeds: using() resolves with its result; the failed release is a 'lost' event", async () => {
    const { locks, client, lost } = await closingManager();
    let fence: bigint | undefined;
    const result = await locks
      .using('job', { ttlMs: 10_000 }, async (lease) => {
        fence = lease.fence;
        await client.close();
        return 'the work is done';
      })
      .catch((e: unknown) => e);
    expect(result).toBe('the work is done');
    expect(lost).toEqual([{ name: 'job', fence, reason: expect.stringMatching(/^release failed/) }]);
    await locks.close();
  });

  it("a callback that throws: using() rejects with the callback's error, not the release's", async () => {
    const { locks, client, lost } = await closingManager();
    const own = new Error('insufficient funds');
    const result = await locks
      .using('job', { ttlMs: 10_000 }, async () => {
        await client.close();
        throw own;
      })
      .catch((e: unknown) => e);
    expect(result).toBe(own);
    expect(lost.map((e) => e.reason)).toEqual([expect.stringMatching(/^release failed/)]);
    await locks.close();
  });
});
