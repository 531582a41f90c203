/**
 * The Redis backend's fair line, searched on a real Redis: live waiters
 * queued behind, before and between places whose waiters died (no retry
 * recorded), in numbers around what one grant drops (64), then grants and
 * releases in a random order. After every step, against a model of the
 * line: a grant goes only to the first live waiter still in line (or to
 * the one a release handed the lock to), a granted token is never left in
 * line, and a refused waiter keeps its place.
 */
import { randomBytes } from 'node:crypto';
import { fc } from '@fast-check/vitest';
import { describe, expect, it } from 'vitest';
import { lockToken, redisScenario } from '../support/redis.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const REDIS_URL = process.env.REDIS_URL ?? '';
const TTL_MS = 30_000;
const token = () => randomBytes(16).toString('hex');

const lineArb = fc.record({
  live: fc.integer({ min: 1, max: 4 }),
  // Dead places before every live one (around the 64 one grant drops), between them, and after them.
  before: fc.oneof(fc.integer({ min: 0, max: 5 }), fc.integer({ min: 60, max: 140 })),
  between: fc.array(
    fc.integer({ min: 1, max: 4 }).map((place) => place + 0.5),
    { maxLength: 8 },
  ),
  after: fc.integer({ min: 0, max: 5 }),
  // Which live waiter tries next, in turn (indices into the live waiters, wrapped).
  tries: fc.array(fc.nat(), { minLength: 1, maxLength: 24 }),
});

describe.runIf(needs('REDIS_URL') && needs('DATABASE_URL'))('the Redis fair line, searched', () => {
  it('grants follow the line past any number of dead places, and no granted token stays in it', {
    timeout: propertyTimeout(120_000),
  }, async () => {
    const scenario = await redisScenario(REDIS_URL);
    const { redis, keys } = scenario;
    const backend = scenario.backend();
    let run = 0;
    await fc.assert(
      fc.asyncProperty(lineArb, async ({ live, before, between, after, tries }) => {
        const name = `line-${run++}`;
        const holder = token();
        expect(await backend.grant(name, holder, TTL_MS, null)).not.toBeNull();
        const waiters = Array.from({ length: live }, token);
        for (const t of waiters) expect(await backend.grant(name, t, TTL_MS, null, { waiting: true })).toBeNull();
        // The model: the line in order of place (live waiters at 1, 2, … as the grant script places them).
        const placed = waiters.map((t, i) => ({ place: i + 1, token: t, live: true }));
        for (const place of [
          ...Array.from({ length: before }, (_, i) => -1 - i),
          ...between,
          ...Array.from({ length: after }, (_, i) => live + 1 + i),
        ]) {
          const dead = { place, token: token(), live: false };
          placed.push(dead);
          await redis.zadd(keys.queue(name), String(place), dead.token);
        }
        const line = placed.sort((a, b) => a.place - b.place);
        const inLine = async (t: string) => (await redis.zscore(keys.queue(name), t)) !== null;
        const heldBy = () => lockToken(redis, keys.lock(name));
        // A live waiter keeps retrying (a real one every few hundred ms): before each step its last retry
        // is recorded as now, by the server's clock, so a slow step of this test never makes it look gone
        // (a handoff needs a retry within 500 ms; a grant drops places not retried for 1 s).
        const keepAlive = async () => {
          const [seconds, micros] = await redis.time();
          const now = String(Number(seconds) * 1000 + Math.floor(Number(micros) / 1000));
          for (const e of line) if (e.live) await redis.zadd(keys.seen(name), now, e.token);
        };
        // A release hands the lock to the head of the line if its waiter is live.
        const release = async (t: string) => {
          await keepAlive();
          expect(await backend.release(name, t)).toBe(true);
          const head = line[0];
          if (head?.live) line.shift();
          expect(await heldBy()).toBe(head?.live ? head.token : null);
        };

        await release(holder);
        for (const i of tries) {
          const left = line.filter((e) => e.live);
          if (left.length === 0) break;
          const t = (left[i % left.length] as { token: string }).token;
          const owner = await heldBy();
          await keepAlive();
          const grant = await backend.grant(name, t, TTL_MS, null, { waiting: true });
          let due = owner === t;
          if (owner === null) {
            // A free lock: the grant drops at most 64 dead heads, then goes to the head only.
            for (let n = 0; n < 64 && line[0] !== undefined && !line[0].live; n++) line.shift();
            due = line[0]?.token === t;
            if (due) line.shift();
          }
          if (!due) {
            expect(grant).toBeNull();
            expect(await inLine(t)).toBe(true); // a refused waiter keeps its place
            continue;
          }
          expect(grant).not.toBeNull();
          expect(await inLine(t)).toBe(false);
          expect(await redis.zscore(keys.seen(name), t)).toBeNull();
          expect(await redis.zcard(keys.queue(name))).toBe(line.length);
          await release(t);
        }
        await redis.del(keys.queue(name), keys.seen(name), keys.lock(name));
      }),
      propertyParams({ numRuns: propertyRuns(150) }),
    );
  });
});
