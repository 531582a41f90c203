/**
 * Work a backend runs through `GrantOptions.recovering` (the Redis backend:
 * a new fence epoch) is not counted in `waitMs`, and the acquire's signal
 * still ends the wait at once. Tested on the generic lock manager with a
 * backend of the test's own that keeps its locks in this process, as a
 * user-written backend would call `recovering` — overlapping, nested, with
 * an abort before, during or between its pauses. The Redis backend's own
 * cases are in redis.test.ts.
 */
import { describe, expect, it } from 'vitest';
import { LockUnavailableError } from '../../src/errors.js';
import type { Grant, GrantOptions, LockBackend } from '../../src/fencing/backend.js';
import { deadlineCounts } from '../../src/fencing/deadlines.js';
import { toFence } from '../../src/fencing/fence.js';
import { createLockManager } from '../../src/fencing/lock-manager.js';
import { sleep } from '../support/sleep.js';

type Recovering = NonNullable<GrantOptions['recovering']>;

/**
 * Locks in a Map; before a grant, `before(name, recovering)` runs — where a
 * test makes the backend pause — and `granted` counts the grants that landed.
 */
function localBackend(before: (name: string, recovering: Recovering) => Promise<void>) {
  const held = new Map<string, string>();
  const waiters = new Set<() => void>();
  let fence = 0n;
  const granted: string[] = [];
  const backend: LockBackend = {
    kind: 'local',
    async grant(name, token, _ttlMs, _holder, options): Promise<Grant | null> {
      await before(name, options?.recovering ?? ((work) => work()));
      if (held.has(name) && held.get(name) !== token) return null;
      held.set(name, token);
      granted.push(name);
      fence += 1n;
      return { fence: toFence(fence) };
    },
    extend: async (name, token) => held.get(name) === token,
    async release(name, token) {
      if (held.get(name) !== token) return false;
      held.delete(name);
      for (const wake of waiters) wake();
      return true;
    },
    inspect: async () => null,
    waitForRelease: (_name, ms) =>
      new Promise<void>((resolve) => {
        const wake = () => {
          waiters.delete(wake);
          clearTimeout(timer);
          resolve();
        };
        const timer = setTimeout(wake, ms);
        waiters.add(wake);
      }),
    close: async () => {},
  };
  return { backend, held, granted };
}

/** A pause of `ms`, run through the backend's `recovering`. */
const pauseFor = (recovering: Recovering, ms: number) => recovering(() => sleep(ms));

describe('work a backend runs through recovering() (its time not counted in waitMs)', () => {
  it('overlapping pauses count once: the attempt is not cut short while either runs, and no deadline is left armed', async () => {
    const since = deadlineCounts().scheduled;
    const { backend } = localBackend(async (_name, recovering) => {
      await Promise.all([pauseFor(recovering, 150), pauseFor(recovering, 300)]);
    });
    const manager = createLockManager(backend);
    const lease = await manager.acquire('parallel', { ttlMs: 5_000, waitMs: 50 });
    expect(await lease.release()).toBe('released');
    expect(deadlineCounts(since).live).toBe(0);
  });

  it("the lease's expiry counts from the end of the last pause: the grant that takes the lock is sent after it", async () => {
    let pauseEnded = 0;
    const { backend } = localBackend(async (_name, recovering) => {
      await pauseFor(recovering, 400);
      pauseEnded = performance.now();
    });
    const manager = createLockManager(backend);
    // A TTL shorter than the pause: counted from the attempt's start, the lease would come back expired.
    const lease = await manager.acquire('expiry', { ttlMs: 200, waitMs: 50 });
    expect(lease.expiresAt).toBeGreaterThan(pauseEnded);
    await lease.release();
  });

  it('nested pauses: the outer one decides when the wait runs again', async () => {
    const { backend } = localBackend(async (_name, recovering) => {
      await recovering(async () => {
        await pauseFor(recovering, 100);
        await sleep(200);
      });
    });
    const manager = createLockManager(backend);
    const lease = await manager.acquire('nested', { ttlMs: 5_000, waitMs: 50 });
    expect(await lease.release()).toBe('released');
  });

  it('an abort before the first pause ends the acquire when the pause is asked for; the backend is stopped there', async () => {
    let reachedWork = false;
    const stopped = new AbortController();
    const { backend, granted } = localBackend(async (_name, recovering) => {
      stopped.abort(); // while the first round trip was under way
      await recovering(async () => {
        reachedWork = true;
      });
    });
    const manager = createLockManager(backend);
    const err = await manager
      .acquire('early', { ttlMs: 5_000, waitMs: 10_000, signal: stopped.signal })
      .catch((e: unknown) => e);
    expect(err).toBeInstanceOf(LockUnavailableError);
    expect((err as LockUnavailableError).reason).toBe('aborted');
    expect(reachedWork).toBe(false);
    expect(granted).toEqual([]);
  });

  it('an abort between two pauses ends the acquire; the backend is stopped at the end of the pause it is in', async () => {
    const stopped = new AbortController();
    let pauses = 0;
    const { backend, granted } = localBackend(async (_name, recovering) => {
      await pauseFor(recovering, 20);
      stopped.abort(); // between the pauses: a round trip of the backend's own
      for (let i = 0; i < 50; i++) {
        await pauseFor(recovering, 20);
        pauses++;
      }
    });
    const manager = createLockManager(backend);
    const err = await manager
      .acquire('between', { ttlMs: 5_000, waitMs: 10_000, signal: stopped.signal })
      .catch((e: unknown) => e);
    expect((err as LockUnavailableError).reason).toBe('aborted');
    expect(pauses).toBe(0);
    expect(granted).toEqual([]);
  });

  it('with waitMs 0 too, an abort during a pause ends the acquire at once; what lands later is given back', async () => {
    const stopped = new AbortController();
    let finish!: () => void;
    const gate = new Promise<void>((resolve) => {
      finish = resolve;
    });
    const { backend, held } = localBackend(async (_name, recovering) => {
      await recovering(() => gate);
    });
    const manager = createLockManager(backend);
    const acquiring = manager
      .acquire('no-wait', { ttlMs: 5_000, waitMs: 0, signal: stopped.signal })
      .catch((e: unknown) => e);
    await sleep(20);
    stopped.abort();
    const err = await acquiring; // settles while the pause is still going on
    expect((err as LockUnavailableError).reason).toBe('aborted');
    finish();
    await sleep(20);
    expect(held.has('no-wait')).toBe(false);
  });

  it('acquireAll: a pause on one name moves the deadline of the names after it', async () => {
    const waitMs = 300;
    const { backend, held } = localBackend(async (name, recovering) => {
      if (name === 'a') await pauseFor(recovering, 2 * waitMs);
    });
    const manager = createLockManager(backend);
    // 'b' is held by someone else until shortly after 'a' is granted: the wait for it starts after the pause.
    const holder = await manager.acquire('b', { ttlMs: 5_000 });
    const all = manager.acquireAll(['a', 'b'], { ttlMs: 5_000, waitMs });
    for (let i = 0; i < 200 && !held.has('a'); i++) await sleep(10);
    setTimeout(() => void holder.release(), 20);
    const leases = await all;
    expect(leases.map((l) => l.name)).toEqual(['a', 'b']);
    for (const lease of leases) await lease.release();
  });
});
