/**
 * A lease's `expiresAt` against the real Redis, searched: extensions of
 * random TTLs are sent (each applied by Redis as it arrives) while
 * fast-check's scheduler decides when each reply reaches the lease, in any
 * order. After every step the lease must not expect to hold the lock longer
 * than Redis will keep it (read by PTTL). Then the same for a lease a
 * release handed over, whose confirmation is sent among the extensions and
 * answered, like them, whenever the scheduler says.
 */
import { fc } from '@fast-check/vitest';
import { describe, expect, it } from 'vitest';
import { forwardTo, type LockBackend } from '../../src/fencing/backend.js';
import { REDIS_HANDOFF_CONFIRM_MS } from '../../src/fencing/backends/redis/backend.js';
import type { Lease } from '../../src/fencing/lease.js';
import { createLockManager } from '../../src/fencing/lock-manager.js';
import { type RedisScenario, redisScenario } from '../support/redis.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const REDIS_URL = process.env.REDIS_URL ?? '';
// Far apart, so a wrong estimate is off by seconds, never by the milliseconds a round trip takes.
const ttlArb = fc.constantFrom(2_000, 5_000, 30_000, 60_000);
const stepsArb: fc.Arbitrary<Step[]> = fc.array(
  fc.oneof(
    ttlArb.map((ttl) => ({ extend: ttl })),
    fc.constant({ reply: true as const }),
  ),
  {
    minLength: 1,
    maxLength: 12,
  },
);

// Redis read the TTL at some moment of the round trip (and rounds it down to the ms): the lock expires
// no later than the round trip's end plus PTTL plus 1 ms. An estimate beyond that is wrong.
async function withinRedis(redis: RedisScenario['redis'], lockKey: string, lease: Lease): Promise<void> {
  const pttl = await redis.pttl(lockKey);
  const after = performance.now();
  if (lease.signal.aborted) return;
  expect(pttl).toBeGreaterThan(0);
  expect(after + pttl + 1).toBeGreaterThanOrEqual(lease.expiresAt);
}

type Step = { extend: number } | { reply: true };

/**
 * Sends the steps' extensions and lets the scheduler answer one pending call per `reply` step (then
 * all that are left), checking the estimate after each; `before` runs once, ahead of step `at` (or
 * after the last one). Every extension must have held, and the lease still holds at the end.
 */
async function play(
  s: fc.Scheduler,
  steps: readonly Step[],
  lease: Lease,
  check: () => Promise<void>,
  before?: { at: number; run: () => Promise<void> },
): Promise<void> {
  const replies: Promise<unknown>[] = [];
  for (const [i, step] of [...steps, undefined].entries()) {
    if (i === before?.at) await before.run();
    if (!step) break;
    if ('extend' in step) replies.push(lease.extend(step.extend));
    else if (s.count() > 0) await s.waitOne();
    await check();
  }
  while (s.count() > 0) {
    await s.waitOne();
    await check();
  }
  await Promise.all(replies);
  expect(lease.signal.aborted).toBe(false);
  expect(await lease.release()).toBe('released');
}

describe.runIf(needs('REDIS_URL') && needs('DATABASE_URL'))('the lease expiry estimate, searched', () => {
  it('never runs past what Redis holds, whatever order the extensions and their replies come in', {
    timeout: propertyTimeout(120_000),
  }, async () => {
    const scenario = await redisScenario(REDIS_URL);
    const { redis, keys, namespace } = scenario;
    const backend = scenario.backend();
    let run = 0;
    await fc.assert(
      fc.asyncProperty(fc.scheduler(), stepsArb, async (s, steps) => {
        const name = `estimate-${run++}`;
        // Each extension reaches Redis at once; its reply reaches the lease when the scheduler says.
        const manager = createLockManager({
          ...forwardTo(backend, namespace),
          extend: (n, token, ttlMs) => s.schedule(backend.extend(n, token, ttlMs)),
        });
        const lease = await manager.acquire(name, { ttlMs: 30_000 });
        const check = () => withinRedis(redis, keys.lock(name), lease);
        await play(s, steps, lease, check);
      }),
      propertyParams({ numRuns: propertyRuns(100) }),
    );
  });

  it('a handed-over lease: its confirmation among the extensions, all answered in any order, never runs past Redis', {
    timeout: propertyTimeout(300_000),
  }, async () => {
    const scenario = await redisScenario(REDIS_URL);
    const { redis, keys, namespace } = scenario;
    const backend = scenario.backend();
    const confirm = backend.confirm as NonNullable<LockBackend['confirm']>;
    let run = 0;
    let confirmed = 0;
    await fc.assert(
      fc.asyncProperty(fc.scheduler(), stepsArb, fc.nat({ max: 12 }), async (s, steps, confirmAt) => {
        const name = `handed-${run++}`;
        let confirmSent = () => {};
        const sent = new Promise<true>((resolve) => {
          confirmSent = () => resolve(true);
        });
        // The confirmation and each extension reach Redis at once; their replies, when the scheduler says.
        const manager = createLockManager(
          {
            ...forwardTo(backend, namespace),
            extend: (n, token, ttlMs) => s.schedule(backend.extend(n, token, ttlMs)),
            confirm: (n, token, ttlMs, holder, fence) => {
              const reply = confirm(n, token, ttlMs, holder, fence);
              confirmSent();
              return s.schedule(reply);
            },
          },
          { queuedRetryMs: { min: 150, max: 150 } }, // as redisLockManager's waiters
        );
        const holder = await manager.acquire(name, { ttlMs: 30_000 });
        const pending = manager.acquire(name, { ttlMs: 30_000, waitMs: 10_000 });
        for (let i = 0; i < 500 && (await redis.zcard(keys.queue(name))) === 0; i++) await sleep(5);
        expect(await holder.release()).toBe('released');
        const lease = await pending;
        // A handed-over lease expects the lock only until the confirmation window's end; a waiter whose own
        // retry landed first took the lock by its grant, with the full TTL, and sends no confirmation (then
        // this run searches extensions only). Told apart before any extension moves the estimate.
        const handedOver = lease.expiresAt - performance.now() <= REDIS_HANDOFF_CONFIRM_MS;
        const check = () => withinRedis(redis, keys.lock(name), lease);
        await check();
        // The lease sends its confirmation a little into the window. Waited for only where one is coming: a
        // wait for nothing could outlast a 2 s extension whose later replies the scheduler still holds.
        const confirmation = async () => {
          if (!handedOver) return;
          const wasSent = await Promise.race([sent, sleep(REDIS_HANDOFF_CONFIRM_MS).then(() => false)]);
          expect(wasSent).toBe(true);
          confirmed++;
          await check();
        };
        await play(s, steps, lease, check, { at: Math.min(confirmAt, steps.length), run: confirmation });
      }),
      propertyParams({ numRuns: propertyRuns(30) }),
    );
    expect(confirmed).toBeGreaterThan(0); // the search did reach the confirmation
  });
});
