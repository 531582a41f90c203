import { AsyncLocalStorage } from 'node:async_hooks';
import { execFileSync } from 'node:child_process';
import { performance } from 'node:perf_hooks';
import { fc } from '@fast-check/vitest';
import { describe, expect, it } from 'vitest';
import { atDeadline, cancelDeadline, type Deadline, deadlineCounts } from '../../src/fencing/deadlines.js';
import { propertyParams } from '../property/support.js';

const settle = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

// Waits (bounded) until every deadline scheduled since the first `since` that was not cancelled has fired.
// Counted from `since`: the deadlines are one per process, and a worker runs file after file (isolate:
// false), so a lease an earlier file left to expire may still be pending here (CI saw one).
async function drained(since: number): Promise<void> {
  for (let i = 0; i < 400 && deadlineCounts(since).live > 0; i++) await settle(5);
}

describe('local deadlines (one shared timer for leases and waiting attempts)', () => {
  it('fires every deadline that was not cancelled, once, never early, earliest first — whatever the order of scheduling and cancelling', async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.record({ inMs: fc.integer({ min: 0, max: 40 }), cancel: fc.boolean() }), {
          minLength: 1,
          maxLength: 300,
        }),
        async (plan) => {
          const fired: { i: number; at: number; early: boolean }[] = [];
          const since = deadlineCounts().scheduled;
          const start = performance.now();
          const scheduled: Deadline[] = plan.map(({ inMs }, i) => {
            const at = start + inMs;
            return atDeadline(at, () => fired.push({ i, at, early: performance.now() < at }));
          });
          // Each cancelled twice: the second changes nothing.
          for (let twice = 0; twice < 2; twice++)
            plan.forEach(({ cancel }, i) => {
              if (cancel) cancelDeadline(scheduled[i]);
            });
          await drained(since);
          expect(deadlineCounts(since).live).toBe(0);
          // Cancelling after the fact changes nothing either.
          for (const d of scheduled) cancelDeadline(d);
          expect(deadlineCounts(since).live).toBe(0);
          const expected = plan.flatMap(({ cancel }, i) => (cancel ? [] : [i]));
          expect(fired.map((f) => f.i).sort((a, b) => a - b)).toEqual(expected);
          expect(fired.filter((f) => f.early)).toEqual([]);
          // Earliest first; at the same time, in the order they were scheduled.
          expect(fired.map((f) => f.i)).toEqual([...fired].sort((a, b) => a.at - b.at || a.i - b.i).map((f) => f.i));
        },
      ),
      propertyParams({ numRuns: 25 }),
    );
  });

  it('keeps its promises when callbacks schedule and cancel deadlines themselves, keep-alive ones among them, and lets go of the process after', async () => {
    const step = fc.record({
      inMs: fc.integer({ min: 0, max: 30 }),
      keepAlive: fc.boolean(),
      cancel: fc.boolean(),
      // From inside its callback: a deadline of its own, and a cancel of another one.
      child: fc.option(fc.record({ inMs: fc.integer({ min: 0, max: 10 }), keepAlive: fc.boolean() })),
      cancels: fc.option(fc.nat()),
    });
    await fc.assert(
      fc.asyncProperty(fc.array(step, { minLength: 1, maxLength: 60 }), async (plan) => {
        interface Entry {
          readonly order: number;
          readonly at: number;
          deadline?: Deadline;
          cancelled: boolean;
          fired: number;
          early: boolean;
        }
        const entries: Entry[] = [];
        const firedOrder: Entry[] = [];
        const since = deadlineCounts().scheduled;
        const keptAliveBefore = deadlineCounts().keepingAlive;
        const schedule = (at: number, keepAlive: boolean, then: () => void): Entry => {
          const entry: Entry = { order: entries.length, at, cancelled: false, fired: 0, early: false };
          entries.push(entry);
          entry.deadline = atDeadline(
            at,
            () => {
              entry.fired++;
              entry.early ||= performance.now() < at;
              firedOrder.push(entry);
              then();
            },
            keepAlive,
          );
          return entry;
        };
        const cancel = (entry: Entry | undefined) => {
          if (!entry) return;
          if (entry.fired === 0) entry.cancelled = true;
          cancelDeadline(entry.deadline);
        };
        const start = performance.now();
        const top = plan.map((p) =>
          schedule(start + p.inMs, p.keepAlive, () => {
            if (p.child) schedule(performance.now() + p.child.inMs, p.child.keepAlive, () => {});
            if (p.cancels !== null) cancel(top[p.cancels % top.length]);
          }),
        );
        plan.forEach((p, i) => {
          if (p.cancel) cancel(top[i]);
        });
        await drained(since);
        expect(deadlineCounts(since).live).toBe(0);
        for (const e of entries) expect(e.fired).toBe(e.cancelled ? 0 : 1);
        expect(entries.filter((e) => e.early)).toEqual([]);
        // Earliest first; at the same time, in the order they were scheduled.
        const sorted = [...firedOrder].sort((a, b) => a.at - b.at || a.order - b.order);
        expect(firedOrder.map((e) => e.order)).toEqual(sorted.map((e) => e.order));
        // No keep-alive deadline of these is left holding the process.
        expect(deadlineCounts().keepingAlive).toBe(keptAliveBefore);
      }),
      propertyParams({ numRuns: 25 }),
    );
  });

  it('a deadline earlier than every one pending fires first (the shared timer is re-armed for it)', async () => {
    const order: string[] = [];
    const since = deadlineCounts().scheduled;
    const late = atDeadline(performance.now() + 5_000, () => order.push('late'));
    atDeadline(performance.now() + 5, () => order.push('early'));
    for (let i = 0; i < 400 && order.length === 0; i++) await settle(5);
    expect(order).toEqual(['early']);
    cancelDeadline(late);
    expect(deadlineCounts(since).live).toBe(0);
  });

  it("keeps the process alive only while a waiting attempt's cut-off is pending, never for a lease's expiry", () => {
    // process.getActiveResourcesInfo() lists the timers that keep the process alive (ref'd ones).
    const alive = () => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length;
    const base = alive();
    const since = deadlineCounts().scheduled;
    // None of these can fire before this synchronous test ends, however early they are.
    // The earliest yet: the shared timer is armed anew for it, and does not keep the process alive.
    const lease = atDeadline(performance.now() + 1, () => {});
    expect(alive()).toBe(base);
    // Later than the armed timer: that timer is kept, and now keeps the process alive.
    const attempt = atDeadline(performance.now() + 60_000, () => {}, true);
    expect(alive()).toBe(base + 1);
    // Earlier still: the timer armed anew for it keeps the process alive too.
    const second = atDeadline(performance.now() + 0.5, () => {}, true);
    expect(alive()).toBe(base + 1);
    cancelDeadline(attempt);
    expect(alive()).toBe(base + 1);
    cancelDeadline(second);
    expect(alive()).toBe(base);
    cancelDeadline(lease);
    expect(deadlineCounts(since).live).toBe(0);
  });

  it('fires each deadline in the async context it was scheduled in, not in that of whoever armed the shared timer last', async () => {
    const request = new AsyncLocalStorage<string>();
    const seen: string[] = [];
    // B's deadline is earlier than A's: the shared timer is armed anew inside B's context.
    request.run('A', () => atDeadline(performance.now() + 30, () => seen.push(`A sees ${request.getStore()}`)));
    request.run('B', () => atDeadline(performance.now() + 10, () => seen.push(`B sees ${request.getStore()}`)));
    for (let i = 0; i < 400 && seen.length < 2; i++) await settle(5);
    expect(seen).toEqual(['B sees B', 'A sees A']);
  });

  it("a waiting acquire's cut-off comes even when nothing else keeps the process alive (a child process on a backend that never answers)", () => {
    const out = execFileSync(process.execPath, ['--import', 'tsx', 'test/fixtures/acquire-never-answered.ts'], {
      encoding: 'utf8',
      timeout: 30_000,
    });
    expect(JSON.parse(out.trim())).toEqual({ outcome: 'rejected', code: 'lock_service' });
  });

  it('a callback that throws does not hold back the deadlines due with it; each error is uncaught on its own, after them', () => {
    const out = execFileSync(process.execPath, ['--import', 'tsx', 'test/fixtures/deadline-throws.ts'], {
      encoding: 'utf8',
      timeout: 30_000,
    });
    expect(JSON.parse(out.trim().split('\n').pop() as string)).toEqual({
      fired: ['first', 'second', 'third'],
      uncaught: ['3 fired: the first callback threw', '3 fired: the third callback threw'],
    });
  });

  it('refuses a deadline that is not a time, and never fires one at +Infinity (cancelling it drops it)', async () => {
    expect(() => atDeadline(Number.NaN, () => {})).toThrow(TypeError);
    const before = deadlineCounts().scheduled;
    let fired = false;
    const never = atDeadline(Number.POSITIVE_INFINITY, () => {
      fired = true;
    });
    // A deadline due now is served by the shared timer; the one at +Infinity stays pending.
    let due = false;
    atDeadline(performance.now(), () => {
      due = true;
    });
    for (let i = 0; i < 400 && !due; i++) await settle(5);
    expect(due).toBe(true);
    expect(fired).toBe(false);
    expect(deadlineCounts(before).live).toBe(1);
    cancelDeadline(never);
    expect(deadlineCounts(before).live).toBe(0);
  });

  it('sweeps cancelled deadlines out: 10,000 leases released long before their TTL leave no entries behind', () => {
    const far = performance.now() + 60_000;
    const before = deadlineCounts();
    for (let i = 0; i < 10_000; i++) cancelDeadline(atDeadline(far + i, () => {}));
    expect(deadlineCounts(before.scheduled).live).toBe(0);
    // At most the cancelled entries since the last sweep (a sweep runs when they outnumber the live ones past
    // 64), beside what an earlier file of this worker left pending.
    expect(deadlineCounts().held).toBeLessThanOrEqual(before.live + Math.max(65, before.live + 1));
  });
});
