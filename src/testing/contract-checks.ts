/**
 * The in-process checks of the lock backend contract (see contract.ts and
 * the README's "Writing a lock backend"). Each talks to the backend
 * directly, one primitive at a time, except the bad-input check, which goes
 * through `createLockManager` because refusing bad input is its job.
 */
import { randomBytes } from 'node:crypto';
import { setTimeout as delay } from 'node:timers/promises';
import { InvalidArgumentError } from '../errors.js';
import type { LockBackend } from '../fencing/backend.js';
import { createLockManager, type LockManager } from '../fencing/lock-manager.js';
import type { AcquireOptions } from '../fencing/options.js';
import type { ContractExpect, ContractSubject } from './contract.js';

/** A token like the manager's: random, unique per acquire. */
export function contractToken(): string {
  return randomBytes(16).toString('hex');
}

/** @internal Grants `name` to `token` or fails the check: the lock is expected free. */
export async function grantFree(
  backend: LockBackend,
  name: string,
  token: string,
  ttlMs: number,
  holder: string | null = null,
) {
  const grant = await backend.grant(name, token, ttlMs, holder);
  if (!grant) throw new Error(`the contract expected lock ${name} to be free, but grant returned null`);
  return grant;
}

/** A re-sent grant for the holding token returns the same fence; another token gets null. */
export async function checkIdempotentGrant(subject: ContractSubject, expect: ContractExpect, ttlMs: number) {
  const { backend } = subject;
  const token = contractToken();
  const first = await grantFree(backend, 'idempotent', token, ttlMs);
  const again = await backend.grant('idempotent', token, ttlMs, null);
  expect(again?.fence).toBe(first.fence);
  const third = await backend.grant('idempotent', token, ttlMs, null, { waiting: true });
  expect(third?.fence).toBe(first.fence);
  expect(await backend.grant('idempotent', contractToken(), ttlMs, null)).toBe(null);
  expect((await backend.inspect('idempotent'))?.fence).toBe(first.fence);
  expect(await backend.release('idempotent', token)).toBe(true);
}

/** `release` and `extend` with a token that does not hold the lock change nothing and answer false. */
export async function checkTokenChecked(subject: ContractSubject, expect: ContractExpect, ttlMs: number) {
  const { backend } = subject;
  const token = contractToken();
  const grant = await grantFree(backend, 'tokens', token, ttlMs);
  const stranger = contractToken();
  expect(await backend.release('tokens', stranger)).toBe(false);
  expect(await backend.extend('tokens', stranger, ttlMs)).toBe(false);
  expect((await backend.inspect('tokens'))?.fence).toBe(grant.fence);
  expect(await backend.grant('tokens', stranger, ttlMs, null)).toBe(null);
  expect(await backend.extend('tokens', token, ttlMs)).toBe(true);
  expect(await backend.release('tokens', token)).toBe(true);
  expect(await backend.inspect('tokens')).toBe(null);
  // Released once: a second release and an extend of the same token find nothing to act on.
  expect(await backend.release('tokens', token)).toBe(false);
  expect(await backend.extend('tokens', token, ttlMs)).toBe(false);
}

/**
 * A holder whose lease ran out (or, per `loseLease`, was ended) releases
 * late: the release answers false (lost) and the new holder keeps the lock
 * with its higher fence.
 */
export async function checkLateRelease(subject: ContractSubject, expect: ContractExpect, ttlMs: number) {
  const { backend } = subject;
  const old = contractToken();
  const shortTtl = subject.loseLease ? ttlMs : 1_000;
  const first = await grantFree(backend, 'late', old, shortTtl);
  await subject.loseLease?.('late');
  const next = contractToken();
  // Bounded: at most 400 attempts, 50 ms apart (20 s), for the TTL to run out by the service's clock.
  let second = null;
  for (let attempt = 0; attempt < 400 && !second; attempt++) {
    second = await backend.grant('late', next, ttlMs, 'next');
    if (!second) await delay(50);
  }
  expect(second === null ? 'never granted to the next holder' : 'granted').toBe('granted');
  if (!second) return;
  expect(second.fence > first.fence).toBe(true);
  expect(await backend.release('late', old)).toBe(false);
  expect(await backend.extend('late', old, ttlMs)).toBe(false);
  const info = await backend.inspect('late');
  expect({ fence: info?.fence, holder: info?.holder }).toEqual({ fence: second.fence, holder: 'next' });
  expect(await backend.release('late', next)).toBe(true);
}

/** 1,000 grant/release rounds on one lock: every fence is above the one before. */
export async function checkIncreasingFences(subject: ContractSubject, expect: ContractExpect, ttlMs: number) {
  const { backend } = subject;
  const fences: bigint[] = [];
  for (let i = 0; i < 1_000; i++) {
    const token = contractToken();
    const grant = await grantFree(backend, 'sequence', token, ttlMs);
    fences.push(grant.fence);
    await backend.release('sequence', token);
  }
  const backwards = fences.flatMap((fence, i) => (i > 0 && fence <= (fences[i - 1] as bigint) ? [i] : []));
  expect({ grants: fences.length, backwards }).toEqual({ grants: 1_000, backwards: [] });
}

/**
 * A waiter on a held lock resolves after the release, not at its own
 * timeout: its wait is far longer than the check, and its abort signal (the
 * check's bound) must not be what ended it. A backend that opens its
 * notification channel lazily gets a few more releases (bounded).
 */
export async function checkReleaseWakesWaiter(subject: ContractSubject, expect: ContractExpect, ttlMs: number) {
  const { backend } = subject;
  const bound = new AbortController();
  const events: string[] = [];
  let token = contractToken();
  await grantFree(backend, 'wake', token, ttlMs);
  const waiting = backend.waitForRelease('wake', 600_000, bound.signal).then(() => events.push('woke'));
  const giveUp = setTimeout(() => bound.abort(), 60_000);
  try {
    // Let the waiter subscribe (a few turns of the event loop) before the first release.
    await delay(50);
    for (let round = 0; round < 50 && !events.includes('woke'); round++) {
      events.push('released');
      expect(await backend.release('wake', token)).toBe(true);
      await delay(20);
      if (events.includes('woke')) break;
      token = contractToken();
      await grantFree(backend, 'wake', token, ttlMs);
    }
    await waiting;
  } finally {
    clearTimeout(giveUp);
    await backend.release('wake', token).catch(() => false);
  }
  expect(bound.signal.aborted ? 'ended by the check’s bound' : 'woken').toBe('woken');
  const released = events.indexOf('released');
  expect(released >= 0 && released < events.indexOf('woke')).toBe(true);
}

/** The holder label and fence of a held lock; `null` once it is free. */
export async function checkInspect(subject: ContractSubject, expect: ContractExpect, ttlMs: number) {
  const { backend } = subject;
  expect(await backend.inspect('inspected')).toBe(null);
  const token = contractToken();
  const grant = await grantFree(backend, 'inspected', token, ttlMs, 'worker-7');
  const info = await backend.inspect('inspected');
  expect({ name: info?.name, holder: info?.holder, fence: info?.fence }).toEqual({
    name: 'inspected',
    holder: 'worker-7',
    fence: grant.fence,
  });
  const remaining = info?.remainingMs;
  expect(remaining === null || (typeof remaining === 'number' && remaining > 0)).toBe(true);
  const anonymous = contractToken();
  await grantFree(backend, 'anonymous', anonymous, ttlMs);
  expect((await backend.inspect('anonymous'))?.holder).toBe(null);
  await backend.release('anonymous', anonymous);
  await backend.release('inspected', token);
  expect(await backend.inspect('inspected')).toBe(null);
}

/** A backend that counts the calls made on it, to prove none was made. */
function counted(backend: LockBackend): { backend: LockBackend; calls: string[] } {
  const calls: string[] = [];
  const count = <A extends unknown[], R>(method: string, fn: (...args: A) => R) => {
    return (...args: A): R => {
      calls.push(method);
      return fn(...args);
    };
  };
  const leave = backend.leave?.bind(backend);
  const wrapped: LockBackend = {
    kind: backend.kind,
    grant: count('grant', backend.grant.bind(backend)),
    extend: count('extend', backend.extend.bind(backend)),
    release: count('release', backend.release.bind(backend)),
    inspect: count('inspect', backend.inspect.bind(backend)),
    waitForRelease: count('waitForRelease', backend.waitForRelease.bind(backend)),
    ...(leave ? { leave: count('leave', leave) } : {}),
    close: () => backend.close(),
  };
  return { backend: wrapped, calls };
}

/**
 * Every kind of bad name, TTL and wait, through `createLockManager` on a
 * backend that counts its calls: each is an `InvalidArgumentError`, and the
 * backend was never called.
 */
export async function checkBadInputRefused(subject: ContractSubject, expect: ContractExpect) {
  const { backend, calls } = counted(subject.backend);
  const manager = createLockManager(backend, subject.hooks);
  const refusals: string[] = [];
  for (const call of badInputCalls(manager)) {
    const outcome = await Promise.resolve()
      .then(call)
      .then(
        () => 'accepted',
        (err: unknown) => (err instanceof InvalidArgumentError ? 'InvalidArgumentError' : String(err)),
      );
    refusals.push(outcome);
  }
  expect(refusals.filter((r) => r !== 'InvalidArgumentError')).toEqual([]);
  expect(calls).toEqual([]);
}

/** Calls with every kind of bad name, TTL and wait the manager must refuse. */
function badInputCalls(manager: LockManager): (() => unknown)[] {
  const ok: AcquireOptions = { ttlMs: 1000, waitMs: 0 };
  const badNames = [
    '',
    'x'.repeat(1025),
    'é'.repeat(513),
    'lone \ud800 surrogate',
    'nul\u0000',
    42 as unknown as string,
  ];
  const badTtls = [0, -1, 1.5, Number.NaN, 86_400_001, Number.POSITIVE_INFINITY];
  const calls: (() => unknown)[] = [];
  for (const name of badNames) {
    calls.push(
      () => manager.acquire(name, ok),
      () => manager.tryAcquire(name, ok),
      () => manager.using(name, ok, () => 1),
      () => manager.acquireAll(['fine', name], ok),
      () => manager.inspect(name),
    );
  }
  for (const ttlMs of badTtls) {
    calls.push(
      () => manager.acquire('fine', { ttlMs }),
      () => manager.tryAcquire('fine', { ttlMs }),
      () => manager.using('fine', { ttlMs }, () => 1),
      () => manager.acquireAll(['fine'], { ttlMs }),
    );
  }
  calls.push(
    () => manager.acquire('fine', { ttlMs: 1000, waitMs: -1 }),
    () => manager.acquire('fine', { ttlMs: 1000, waitMs: Number.NaN }),
    () => manager.acquireAll(['fine'], { ttlMs: 1000, waitMs: -1 }),
    () => manager.acquireAll([], ok),
    () => manager.acquire('fine', undefined as unknown as AcquireOptions),
    () => manager.using('fine', ok, undefined as unknown as () => unknown),
  );
  return calls;
}
