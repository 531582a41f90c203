/**
 * A lease's `expiresAt` against the real Redis, searched: extensions of
 * random TTLs are sent (each applied by Redis as it arrives) while
 * fast-check's scheduler decides when each reply reaches the lease, in any
 * order. After every step the lease must not expect to hold the lock longer
 * than Redis will keep it (read by PTTL).
 */
import { fc } from '@fast-check/vitest';
import { describe, expect, it } from 'vitest';
import { forwardTo } from '../../src/fencing/backend.js';
import { createLockManager } from '../../src/fencing/lock-manager.js';
import { redisScenario } from '../support/redis.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const REDIS_URL = process.env.REDIS_URL ?? '';
// Far apart, so a wrong estimate is off by seconds, never by the milliseconds a round trip takes.
const ttlArb = fc.constantFrom(2_000, 5_000, 30_000, 60_000);
const stepsArb = fc.array(
  fc.oneof(
    ttlArb.map((ttl) => ({ extend: ttl })),
    fc.constant({ reply: true as const }),
  ),
  {
    minLength: 1,
    maxLength: 12,
  },
);

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
        // Redis read the TTL at some moment of the round trip (and rounds it down to the ms): the lock
        // expires no later than the round trip's end plus PTTL plus 1 ms. An estimate beyond that is wrong.
        const check = async () => {
          const pttl = await redis.pttl(keys.lock(name));
          const after = performance.now();
          if (lease.signal.aborted) return;
          expect(pttl).toBeGreaterThan(0);
          expect(after + pttl + 1).toBeGreaterThanOrEqual(lease.expiresAt);
        };
        const sent: Promise<unknown>[] = [];
        for (const step of steps) {
          if ('extend' in step) sent.push(lease.extend(step.extend));
          else if (s.count() > 0) await s.waitOne();
          await check();
        }
        while (s.count() > 0) {
          await s.waitOne();
          await check();
        }
        await Promise.all(sent);
        expect(lease.signal.aborted).toBe(false);
        expect(await lease.release()).toBe('released');
      }),
      propertyParams({ numRuns: propertyRuns(100) }),
    );
  });
});
