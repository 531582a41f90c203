/**
 * Helpers shared by the Postgres lease and advisory suites: lock workers in
 * their own processes, message waits that only look past a given point, and
 * bounded polling.
 */
import { createHook } from 'node:async_hooks';
import { sql } from 'drizzle-orm';
import { expect } from 'vitest';
import { execute } from '../../src/driver.js';
import { InvalidArgumentError } from '../../src/errors.js';
import type { LockBackend } from '../../src/fencing/backend.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import type { AcquireOptions } from '../../src/fencing/options.js';
import type { TestDatabase } from '../support/databases.js';
import type { BackendKind } from '../support/managers.js';
import { type Message, startWorker, type Worker } from '../support/processes.js';

export interface WorkerOptions {
  readonly lock: string;
  readonly ttlMs: number;
  readonly waitMs?: number;
  readonly autoExtend?: boolean;
  readonly holder?: string;
}

/** Starts test/workers/lock-worker.ts on the test's own database and namespace. */
export function lockWorker(test: TestDatabase, kind: BackendKind, namespace: string, options: WorkerOptions): Worker {
  if (!test.url) throw new Error('lock workers need a real-Postgres test database');
  return startWorker('test/workers/lock-worker.ts', { kind, namespace, databaseUrl: test.url, ...options });
}

/** Resolves when every worker has said `ready`. */
export async function ready(...workers: Worker[]): Promise<void> {
  await Promise.all(workers.map((w) => w.next((m) => m.event === 'ready', 60_000)));
}

/**
 * Sends `command` and resolves with the first `event` message (or `error`)
 * the worker prints after it: earlier messages of the same kind are ignored.
 */
export async function request(
  worker: Worker,
  command: Record<string, unknown>,
  event: string,
  timeoutMs = 60_000,
): Promise<Message> {
  const from = worker.messages.length;
  worker.send(command);
  const message = await worker.next(
    (m) => worker.messages.indexOf(m) >= from && (m.event === event || m.event === 'error'),
    timeoutMs,
  );
  if (message.event === 'error') throw new Error(`worker ${worker.pid}: ${String(message.message)}`);
  return message;
}

/** Polls `check` every `everyMs` until it returns true, at most `tries` times; returns whether it did. */
export async function eventually(check: () => Promise<boolean>, tries = 400, everyMs = 50): Promise<boolean> {
  for (let i = 0; i < tries; i++) {
    if (await check()) return true;
    await new Promise((r) => setTimeout(r, everyMs));
  }
  return false;
}

/** The `resource` row the workers write: value and fence. */
export async function resourceRow(test: TestDatabase): Promise<{ value: string; lastFence: bigint }> {
  const [row] = await execute(test.db, sql`select value, last_fence::text as last_fence from resource where id = 1`);
  return { value: String(row?.value), lastFence: BigInt(String(row?.last_fence)) };
}

/** Resolves when `signal` aborts, or rejects after `timeoutMs`. */
export function aborted(signal: AbortSignal, timeoutMs = 30_000): Promise<unknown> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return resolve(signal.reason);
    const timer = setTimeout(() => reject(new Error(`signal not aborted within ${timeoutMs} ms`)), timeoutMs);
    signal.addEventListener('abort', () => {
      clearTimeout(timer);
      resolve(signal.reason);
    });
  });
}

/**
 * Records every timer created while `fn` runs by code under `src/fencing/`
 * (unref'd ones included, which `process.getActiveResourcesInfo()` does not
 * list) and returns those still pending when `fn` has finished.
 */
export async function pendingFencingTimers(fn: () => Promise<void>): Promise<{ created: number; pending: string[] }> {
  const live = new Map<number, string>();
  let created = 0;
  const limit = Error.stackTraceLimit;
  const hook = createHook({
    init(id, type) {
      if (type !== 'Timeout') return;
      Error.stackTraceLimit = 40;
      const stack = new Error().stack ?? '';
      Error.stackTraceLimit = limit;
      if (!stack.includes('/src/fencing/')) return;
      created++;
      live.set(id, stack.split('\n').find((line) => line.includes('/src/fencing/')) ?? '');
    },
    destroy(id) {
      live.delete(id);
    },
  });
  hook.enable();
  try {
    await fn();
    // destroy hooks of cleared timers run asynchronously.
    await new Promise((r) => setImmediate(r));
    await new Promise((r) => setImmediate(r));
  } finally {
    hook.disable();
  }
  return { created, pending: [...live.values()] };
}

/** Every call must refuse with InvalidArgumentError, whether it throws or rejects. */
export async function expectInvalid(calls: (() => unknown)[]): Promise<void> {
  for (const call of calls) {
    await expect(Promise.resolve().then(call)).rejects.toBeInstanceOf(InvalidArgumentError);
  }
}

/** Calls with every kind of bad name, TTL and wait the issue lists. */
export function badInputCalls(manager: LockManager): (() => unknown)[] {
  const ok: AcquireOptions = { ttlMs: 1000, waitMs: 0 };
  const badNames = ['', 'x'.repeat(1025), 'é'.repeat(513), 'lone \ud800 surrogate', 'nul\u0000'];
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
      () => manager.acquireAll(['fine'], { ttlMs }),
    );
  }
  calls.push(
    () => manager.acquire('fine', { ttlMs: 1000, waitMs: -1 }),
    () => manager.acquireAll(['fine'], { ttlMs: 1000, waitMs: -1 }),
    () => manager.acquireAll([], ok),
    () => manager.acquire('fine', undefined as unknown as AcquireOptions),
  );
  return calls;
}

/**
 * 1,000 grants from four processes (250 each), each followed by a fenced
 * write: every process sees its fences strictly increase, all 1,000 are
 * distinct, every write applies (grants came in fence order across
 * processes) and the row ends at the highest fence.
 */
export async function expectFencesIncreaseAcrossProcesses(
  test: TestDatabase,
  kind: BackendKind,
  namespace: string,
): Promise<void> {
  const workers = [0, 1, 2, 3].map(() =>
    lockWorker(test, kind, namespace, { lock: 'job', ttlMs: 10_000, waitMs: 60_000 }),
  );
  await ready(...workers);
  const results = await Promise.all(
    workers.map((w) => request(w, { cmd: 'fencedGrants', count: 250 }, 'fencedGrants', 120_000)),
  );
  const all: bigint[] = [];
  for (const result of results) {
    const fences = (result.fences as string[]).map(BigInt);
    expect(fences).toHaveLength(250);
    for (let i = 1; i < fences.length; i++) expect(fences[i]).toBeGreaterThan(fences[i - 1] as bigint);
    expect(result.statuses).toEqual({ applied: 250 });
    all.push(...fences);
  }
  expect(new Set(all).size).toBe(1000);
  let highest = 0n;
  for (const fence of all) if (fence > highest) highest = fence;
  expect((await resourceRow(test)).lastFence).toBe(highest);
}

/**
 * A release wakes a waiter through the backend's notification (LISTEN/NOTIFY),
 * long before the waiter's 50 s timeout. The backend's LISTEN opens lazily,
 * so releases repeat (bounded) until the waiter wakes.
 */
export async function expectReleaseWakesWaiter(backend: LockBackend, manager: LockManager): Promise<void> {
  let woke = false;
  const waiting = backend.waitForRelease('job', 50_000, undefined).then(() => {
    woke = true;
  });
  for (let i = 0; i < 100 && !woke; i++) {
    const lease = await manager.acquire('job', { ttlMs: 10_000 });
    await lease.release();
    await new Promise((r) => setTimeout(r, 20));
  }
  expect(woke).toBe(true);
  await waiting;
}
