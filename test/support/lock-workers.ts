/**
 * Helpers shared by the backend suites beyond the contract: lock workers
 * (test/workers/lock-worker.ts) in their own processes, message waits that
 * only look past a given point, bounded polling, and timer accounting.
 */
import { sql } from 'drizzle-orm';
import { expect } from 'vitest';
import { execute } from '../../src/driver.js';
import { InvalidArgumentError } from '../../src/errors.js';
import type { LockBackend } from '../../src/fencing/backend.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import type { TestDatabase } from './databases.js';
import type { BackendKind } from './managers.js';
import { type Message, startWorker, type Worker } from './processes.js';
import { sleep } from './sleep.js';
import { trackTimers } from './timers.js';

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
    await sleep(everyMs);
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
 * and every local deadline it scheduled (./timers.ts), and returns those
 * still pending when `fn` has finished.
 */
export async function pendingFencingTimers(fn: () => Promise<void>): Promise<{ created: number; pending: string[] }> {
  const timers = trackTimers('/src/fencing/');
  try {
    await fn();
    return { created: timers.created(), pending: await timers.pending() };
  } finally {
    timers.stop();
  }
}

/** Every call must refuse with InvalidArgumentError, whether it throws or rejects. */
export async function expectInvalid(calls: (() => unknown)[]): Promise<void> {
  for (const call of calls) {
    await expect(Promise.resolve().then(call)).rejects.toBeInstanceOf(InvalidArgumentError);
  }
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
    await sleep(20);
  }
  expect(woke).toBe(true);
  await waiting;
}
