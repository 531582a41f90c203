/**
 * One attempt of a lock wait: its deadline, and how its failure reads
 * (worth another attempt, or the service's answer). The README's "Lock
 * managers" and "Errors" sections are the manual.
 */
import { performance } from 'node:perf_hooks';
import { LockServiceError, PalisadeError } from '../errors.js';
import { atDeadline, cancelDeadline, type Deadline } from './deadlines.js';
import type { LockManagerHooks } from './lock-manager.js';

/**
 * @internal Runs `work` with an attempt's cut-off paused: the time it takes
 * is not counted against the deadline (the backend's `GrantOptions.recovering`).
 */
export type Pause = <R>(work: () => Promise<R>) => Promise<R>;

/** After a pause, the attempt gets at least this long for the round trip that follows it. */
const MIN_AFTER_PAUSE_MS = 100;

/**
 * @internal The work `start` begins, or a timeout error at `deadline` (a
 * monotonic time). `start` gets `pause`: while work runs through it the
 * deadline does not run, and it moves later by the time paused (overlapping
 * pauses count once). `signal` aborting ends the attempt at once — a
 * service that does not answer (etcd frozen: its client retries for seconds)
 * does not hold the caller who gave up — and a pause asked for after that
 * fails, so the backend stops. `onPaused(ms)` hears each pause's end. If the work settles after
 * the attempt ended, `onLate(value)` gets its value (undefined if it
 * failed) so a grant nobody waits for can be given back.
 */
export function bounded<T>(
  start: (pause: Pause) => Promise<T>,
  deadline: number,
  onLate: (value: T | undefined) => void,
  signal?: AbortSignal,
  onPaused?: (ms: number) => void,
): Promise<T> {
  if (!Number.isFinite(deadline) && signal === undefined) return start(unpaused);
  // One promise and one shared deadline (./deadlines.ts), not a race between two promises: this runs on every waiting attempt.
  return new Promise<T>((resolve, reject) => {
    let ended = false; // cut short, or settled
    let cut = false;
    let timer: Deadline | undefined;
    let pauses = 0;
    let pausedAt = 0;
    let listening = false;
    const end = () => {
      ended = true;
      cancelDeadline(timer);
      if (listening) signal?.removeEventListener('abort', fire);
    };
    const fire = () => {
      if (ended) return;
      end();
      cut = true;
      reject(new AttemptCutShort());
    };
    // keepAlive: the cut-off must come even when nothing else keeps the process running.
    const arm = () => {
      if (Number.isFinite(deadline)) timer = atDeadline(deadline, fire, true);
    };
    arm();
    if (signal?.aborted) {
      fire();
      return;
    }
    if (signal) {
      listening = true;
      signal.addEventListener('abort', fire, { once: true });
    }
    const pause: Pause = async (work) => {
      if (ended && !cut) return work(); // settled already: nothing to pause
      if (cut) throw new AttemptCutShort(); // nobody waits: the backend stops here
      if (pauses++ === 0) {
        cancelDeadline(timer);
        pausedAt = performance.now();
      }
      try {
        const value = await work();
        if (cut) throw new AttemptCutShort();
        return value;
      } finally {
        if (--pauses === 0 && !ended) {
          const paused = performance.now() - pausedAt;
          deadline = Math.max(deadline + paused, performance.now() + MIN_AFTER_PAUSE_MS);
          arm();
          onPaused?.(paused);
        }
      }
    };
    let work: Promise<T>;
    try {
      work = start(pause);
    } catch (err) {
      // A backend that throws instead of rejecting: the same failure, and no timer left armed.
      end();
      reject(err);
      return;
    }
    work.then(
      (value) => {
        if (cut) return onLate(value);
        end();
        resolve(value);
      },
      (err: unknown) => {
        if (cut) return onLate(undefined);
        end();
        reject(err);
      },
    );
  });
}

const unpaused: Pause = (work) => work();

// What each attempt (by its token: random, one per attempt) is doing besides asking its lock service, while it does.
const steps = new Map<string, string>();

/**
 * @internal Runs `work` as the step `what` of the attempt of `token`: an
 * attempt cut short at the end of its wait during it was waiting on that
 * (an eager claim's database), not on the lock service, and says so.
 */
export async function inStep<T>(token: string, what: string, work: () => Promise<T>): Promise<T> {
  steps.set(token, what);
  try {
    return await work();
  } finally {
    steps.delete(token);
  }
}

/** @internal The step the attempt of `token` is in ({@link inStep}), if any. */
export const stepOf = (token: string): string | undefined => steps.get(token);

/** @internal An attempt abandoned at the wait's deadline (it may still land: then it is given back). */
export class AttemptCutShort extends Error {
  /** `step`: what the attempt was waiting on when it was cut, where that was not the lock service itself. */
  constructor(readonly step?: string) {
    super(`${step ?? 'no answer'} before the wait ended`);
  }
}

// Errors that say "the service did not answer", not "the service said no": worth another attempt.
const NETWORK_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'EPIPE',
  'ETIMEDOUT',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'ENOTFOUND',
  'EAI_AGAIN',
  'CONNECTION_CLOSED',
  'CONNECTION_ENDED',
  'CONNECTION_DESTROYED',
  'CONNECT_TIMEOUT',
]);
const UNREACHABLE_MESSAGE =
  /Stream isn't writeable|Connection is closed|connect ECONNREFUSED|ECONNRESET|Reached the max retries per request|UNAVAILABLE|DEADLINE_EXCEEDED|No connection established|Connection terminated/i;

/** @internal Whether `err` says the service did not answer (worth another attempt), not that it said no. */
export function isUnreachable(err: unknown, hooks: LockManagerHooks): boolean {
  if (err instanceof AttemptCutShort) return true;
  for (let e: unknown = err, depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    if (code === 'lock_service') return true;
    // A timeout on a connected client is the service's answer (it may still apply): not retried here.
    if (code === 'command_timeout') return hooks.lastConnectionError?.() !== undefined;
    if (typeof code === 'string' && (NETWORK_CODES.has(code) || /^(08|57P0)/.test(code))) return true;
    if (e instanceof Error && UNREACHABLE_MESSAGE.test(e.message)) return true;
  }
  return false;
}

/**
 * palisade's own errors pass through (an unreachable service excepted when
 * a wait ended); anything else a backend's client threw (ioredis, etcd3,
 * a socket) becomes a {@link LockServiceError} that keeps it as its cause.
 */
export function serviceError(hooks: LockManagerHooks, kind: string, err: unknown, waitedMs?: number): Error {
  const connection = hooks.lastConnectionError?.();
  if (err instanceof PalisadeError) {
    // At the end of a wait `err` is one isUnreachable accepted (a database connection error, a
    // command timeout while disconnected); elsewhere only a timeout while disconnected is
    // rephrased. Every other error of ours passes through as it is.
    const rephrase =
      (waitedMs !== undefined && err.code !== 'lock_service') ||
      (err.code === 'command_timeout' && connection !== undefined);
    if (!rephrase) return err;
  }
  // Cut short while it waited on something else than the service (an eager claim's database): that one is named.
  if (err instanceof AttemptCutShort && err.step !== undefined) {
    const waited = waitedMs === undefined ? '' : ` (retried for waitMs = ${waitedMs} ms)`;
    return new LockServiceError('postgres', `${err.step} got no answer before the wait ended${waited}`, err);
  }
  const why = describeFailure(connection ?? err);
  const waited = waitedMs === undefined ? '' : ` (retried for waitMs = ${waitedMs} ms)`;
  return new LockServiceError(kind, `the ${kind} lock service is unreachable${waited}: ${why}`, err);
}

function describeFailure(err: unknown): string {
  for (let e: unknown = err, depth = 0; e && depth < 5; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    const message = e instanceof Error ? e.message : String(e);
    if (code === 'ECONNREFUSED' || /ECONNREFUSED/.test(message)) {
      const address = /ECONNREFUSED ([^\s]+)/.exec(message)?.[1];
      return `connection refused${address ? ` at ${address}` : ''} — is the server running, and does the URL point at it?`;
    }
    if (/Stream isn't writeable/.test(message)) {
      return 'the client is not connected (ioredis with enableOfflineQueue: false sends nothing until the connection is ready)';
    }
  }
  if (err instanceof AttemptCutShort) return 'no answer before the wait ended';
  return err instanceof Error ? err.message : String(err);
}
