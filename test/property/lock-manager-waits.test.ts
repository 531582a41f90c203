/**
 * The lock manager's waits, searched: acquires and tryAcquires of one lock
 * on a backend of the test's own (its locks in this process), whose every
 * grant call is a few steps — round trips, pauses through `recovering`
 * (alone, overlapping, nested), a failure before the grant, a reply lost
 * after it — each answered whenever fast-check's scheduler says, among
 * aborts, a rival holder's release and the real timers of `waitMs`.
 * Whatever the order, every call settles (a lease, null, or a
 * PalisadeError); a lease's lock is held by its own grant; a grant nobody
 * took is given back; a grant call its acquire's abort found unanswered
 * (pausing, or on a round trip: the abort cuts the attempt at once), or
 * that began after, yields no lease; a lease
 * never expects its lock for longer than the backend keeps it (its TTL from
 * the moment the grant took effect); and no local deadline is left armed.
 */
import { fc } from '@fast-check/vitest';
import { describe, expect, it } from 'vitest';
import { PalisadeError } from '../../src/errors.js';
import type { Grant, LockBackend } from '../../src/fencing/backend.js';
import { deadlineCounts } from '../../src/fencing/deadlines.js';
import { toFence } from '../../src/fencing/fence.js';
import type { Lease } from '../../src/fencing/lease.js';
import { createLockManager } from '../../src/fencing/lock-manager.js';
import { sleep } from '../support/sleep.js';
import { propertyParams, propertyRuns } from './support.js';

/** One step of a grant call: a round trip, a pause (one, two overlapping, or one inside another), a failure before the grant takes effect, a reply lost after it. */
type Step = 'trip' | 'pause' | 'overlap' | 'nested' | 'fail' | 'lost';

interface Caller {
  /** acquire (waiting up to waitMs) or tryAcquire. */
  readonly kind: 'acquire' | 'try';
  readonly waitMs: number;
  /** The steps of its grant calls, in turn (the k-th call runs calls[k % length]). */
  readonly calls: readonly (readonly Step[])[];
  /** Whether an abort of its signal is among the scheduled events. */
  readonly aborts: boolean;
}

interface Scenario {
  readonly callers: readonly Caller[];
  /** A rival holds the lock at the start; its release is a scheduled event. */
  readonly rival: boolean;
  /** Real milliseconds to let pass between scheduled events, in turn (timers fire meanwhile). */
  readonly gaps: readonly number[];
}

const TTL_MS = 5_000;
const NAME = 'resource';

const stepArb = fc.constantFrom<Step>('trip', 'trip', 'pause', 'overlap', 'nested', 'fail', 'lost');
const callerArb: fc.Arbitrary<Caller> = fc.record({
  kind: fc.constantFrom<Caller['kind']>('acquire', 'acquire', 'try'),
  waitMs: fc.constantFrom(0, 15, 60),
  calls: fc.array(fc.array(stepArb, { minLength: 1, maxLength: 4 }), { minLength: 1, maxLength: 3 }),
  aborts: fc.boolean(),
});
const scenarioArb: fc.Arbitrary<Scenario> = fc.record({
  callers: fc.array(callerArb, { minLength: 1, maxLength: 3 }),
  rival: fc.boolean(),
  gaps: fc.array(fc.constantFrom(0, 0, 1, 5, 20), { minLength: 1, maxLength: 8 }),
});

/** What the backend knows of one grant call. */
interface CallRecord {
  readonly caller: number;
  /** The caller's signal had been aborted when the call began. */
  readonly afterAbort: boolean;
  /** The backend had not answered when the caller's signal was aborted. */
  unansweredAtAbort: boolean;
  /** The backend has answered (a grant, null, or an error). */
  answered: boolean;
}

/** A grant that took effect: its token, and when (the lock lives TTL_MS from then). */
interface Applied {
  readonly token: string;
  readonly at: number;
  readonly call: CallRecord;
}

async function play(s: fc.Scheduler, scenario: Scenario): Promise<void> {
  const since = deadlineCounts().scheduled;
  const held = new Map<string, string>();
  const applied = new Map<bigint, Applied>();
  const wakers = new Set<() => void>();
  const controllers = scenario.callers.map(() => new AbortController());
  const callCounts = scenario.callers.map(() => 0);
  const records: CallRecord[] = [];
  let fence = 0n;
  let active = 0; // grant calls still running (a cut-off call goes on until its next pause)

  const wake = () => {
    for (const w of [...wakers]) w();
  };
  const trip = (label: string) => s.schedule(Promise.resolve(), label);

  const backend: LockBackend = {
    kind: 'local',
    async grant(name, token, _ttlMs, holder, options): Promise<Grant | null> {
      const caller = Number(holder);
      const steps = scenario.callers[caller]?.calls ?? [];
      const made = callCounts[caller] ?? 0;
      callCounts[caller] = made + 1;
      const step = steps[made % steps.length] ?? [];
      const call: CallRecord = {
        caller,
        afterAbort: controllers[caller]?.signal.aborted ?? false,
        unansweredAtAbort: false,
        answered: false,
      };
      records.push(call);
      const recovering = options?.recovering ?? ((work) => work());
      const label = `caller ${caller}`;
      active++;
      try {
        let lost = false;
        for (const kind of step) {
          if (kind === 'trip') await trip(`${label}: round trip`);
          else if (kind === 'pause') await recovering(() => trip(`${label}: pause`));
          else if (kind === 'overlap') {
            await Promise.all([
              recovering(() => trip(`${label}: pause 1 of 2`)),
              recovering(() => trip(`${label}: pause 2 of 2`)),
            ]);
          } else if (kind === 'nested') {
            await recovering(async () => {
              await recovering(() => trip(`${label}: inner pause`));
              await trip(`${label}: rest of outer pause`);
            });
          } else if (kind === 'fail') throw Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' });
          else lost = true;
        }
        const owner = held.get(name);
        if (owner !== undefined && owner !== token) return null;
        held.set(name, token);
        fence += 1n;
        applied.set(fence, { token, at: performance.now(), call });
        if (lost) throw Object.assign(new Error('read ECONNRESET'), { code: 'ECONNRESET' });
        return { fence: toFence(fence) };
      } finally {
        call.answered = true;
        active--;
      }
    },
    extend: async (name, token) => held.get(name) === token,
    async release(name, token) {
      if (held.get(name) !== token) return false;
      held.delete(name);
      wake();
      return true;
    },
    inspect: async () => null,
    waitForRelease: (_name, ms, signal) =>
      new Promise<void>((resolve) => {
        const done = () => {
          wakers.delete(done);
          clearTimeout(timer);
          signal?.removeEventListener('abort', done);
          resolve();
        };
        const timer = setTimeout(done, ms);
        signal?.addEventListener('abort', done, { once: true });
        wakers.add(done);
      }),
    close: async () => {},
  };
  const manager = createLockManager(backend);

  if (scenario.rival) {
    held.set(NAME, 'rival');
    void trip('rival releases').then(() => {
      if (held.get(NAME) === 'rival') held.delete(NAME);
      wake();
    });
  }
  scenario.callers.forEach((caller, i) => {
    if (!caller.aborts) return;
    void trip(`abort caller ${i}`).then(() => {
      for (const call of records) if (call.caller === i && !call.answered) call.unansweredAtAbort = true;
      controllers[i]?.abort();
    });
  });

  const outcomes: (Lease | null | unknown)[] = scenario.callers.map(() => undefined);
  let settled = 0;
  scenario.callers.forEach((caller, i) => {
    const options = { ttlMs: TTL_MS, holder: String(i), signal: controllers[i]?.signal };
    const call =
      caller.kind === 'acquire'
        ? manager.acquire(NAME, { ...options, waitMs: caller.waitMs })
        : manager.tryAcquire(NAME, options);
    call.then(
      (lease) => {
        outcomes[i] = lease;
        settled++;
      },
      (err: unknown) => {
        outcomes[i] = err;
        settled++;
      },
    );
  });

  // Scheduled events one at a time, real time passing between them; bounded in count (and so in time).
  for (let i = 0; i < 3_000 && (settled < scenario.callers.length || active > 0 || s.count() > 0); i++) {
    if (s.count() > 0) await s.waitOne();
    const gap = scenario.gaps[i % scenario.gaps.length] ?? 0;
    await (gap > 0 || s.count() === 0 ? sleep(Math.max(gap, 1)) : Promise.resolve());
  }
  expect(settled, 'every acquire settles').toBe(scenario.callers.length);
  expect(active, 'every grant call ends').toBe(0);
  await sleep(1); // give-backs of late grants are sent without waiting for their answer

  const leases: Lease[] = [];
  for (const outcome of outcomes) {
    if (outcome === null) continue;
    if (outcome instanceof PalisadeError) continue;
    expect(outcome, 'a lease, null or a PalisadeError').toHaveProperty('fence');
    leases.push(outcome as Lease);
  }
  for (const lease of leases) {
    const grant = applied.get(lease.fence);
    expect(grant, 'a lease comes from a grant that took effect').toBeDefined();
    if (!grant) continue;
    expect(held.get(NAME), "a lease's lock is held by its own grant").toBe(grant.token);
    expect(grant.call.afterAbort, 'no lease from a grant call begun after the abort').toBe(false);
    expect(grant.call.unansweredAtAbort, 'no lease from a grant call the abort found unanswered').toBe(false);
    expect(lease.expiresAt, 'the lease expects its lock no longer than TTL from the grant').toBeLessThanOrEqual(
      grant.at + TTL_MS,
    );
  }
  expect(leases.length, 'one lock, at most one lease').toBeLessThanOrEqual(1);
  const owner = held.get(NAME);
  if (owner !== undefined) {
    expect(
      leases.some((l) => applied.get(l.fence)?.token === owner),
      'the lock is held only by a lease that was handed out',
    ).toBe(true);
  }
  for (const lease of leases) expect(await lease.release()).toBe('released');
  await manager.close();
  expect(deadlineCounts(since).live, 'no local deadline left armed').toBe(0);
}

describe('lock manager waits under any order of round trips, pauses, failures, aborts and releases', () => {
  it('every call settles, leases hold their lock, late grants are given back, an abort cuts the grant call under way', async () => {
    await fc.assert(
      fc.asyncProperty(fc.scheduler(), scenarioArb, (s, scenario) => play(s, scenario)),
      propertyParams({ numRuns: propertyRuns(300) }),
    );
  }, 240_000);
});
