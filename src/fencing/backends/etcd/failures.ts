/**
 * How the etcd backend tells a failure worth retrying (a member down, an
 * election under way, a timeout) from one that is not, retries within its
 * budget, and reports what is left as a `LockServiceError`.
 */
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { LockServiceError, PalisadeError } from '../../../errors.js';

const MAX_ATTEMPTS = 12;

/** What one attempt of a call is given: its deadline, for the etcd3 client's call options. */
export interface CallOptions {
  readonly deadline: number;
}

/**
 * A call retried on transient failures, until `until` (a `performance.now()`
 * time: the deadline of the public operation the call is part of, shared by
 * all of its requests) or, without one, for the budget it was built with.
 */
export type RetryingCall = <T>(what: string, fn: (o: CallOptions) => Promise<T>, until?: number) => Promise<T>;

/**
 * A {@link RetryingCall} that spends at most `timeoutMs` per call, retries
 * included, or less when given the deadline of an operation that chains
 * several calls; each attempt is bounded to a third of `timeoutMs`
 * (0.3–2 s). A call whose deadline has already passed is not sent.
 * @throws {LockServiceError} once the deadline passed or the failure is not transient.
 */
export function retryingCall(timeoutMs: number): RetryingCall {
  const attemptMs = Math.min(Math.max(Math.floor(timeoutMs / 3), 300), 2_000);
  return async function call<T>(what: string, fn: (o: CallOptions) => Promise<T>, deadline?: number): Promise<T> {
    const until = deadline ?? performance.now() + timeoutMs;
    if (until <= performance.now()) {
      // An earlier request of the same operation spent the bound: one more would exceed it.
      throw new LockServiceError('etcd', `etcd ${what} not sent: the operation's commandTimeoutMs ran out`);
    }
    for (let attempt = 1; ; attempt++) {
      // One attempt gets a share of the budget: a request stuck on a member that lost its leader is
      // abandoned (it may still apply — every operation here tolerates that) and retried elsewhere.
      const left = Math.max(1, Math.floor(Math.min(until - performance.now(), attemptMs)));
      try {
        return await fn({ deadline: Date.now() + left });
      } catch (err) {
        const pause = Math.min(400, 20 * 2 ** attempt) * (0.5 + Math.random() / 2);
        if (!isTransient(err) || attempt >= MAX_ATTEMPTS || performance.now() + pause >= until) {
          throw withContext(err, `etcd ${what}`);
        }
        await sleep(pause);
      }
    }
  };
}

const TRANSIENT_NAMES = new Set([
  'GRPCUnavailableError',
  'GRPCDeadlineExceededError',
  'GRPCCancelledError',
  'GRPCInternalError',
  'GRPCAbortedError',
  'GRPCResourceExhastedError',
  'BrokenCircuitError',
]);
const TRANSIENT_MESSAGE =
  /UNAVAILABLE|DEADLINE_EXCEEDED|leader changed|no leader|request timed out|timed out|too many requests|not capable|circuit|ECONNREFUSED|ECONNRESET|keep-alive stream ended/i;

/** Member down, election under way, timeout: another attempt (maybe on another member) may succeed. */
export function isTransient(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  return TRANSIENT_NAMES.has(err.constructor.name) || TRANSIENT_MESSAGE.test(err.message);
}

/**
 * etcd3's (and gRPC's) errors become a {@link LockServiceError} that says
 * which operation failed and keeps the original as its cause; palisade's
 * own errors pass through.
 */
export function withContext(err: unknown, what: string): unknown {
  if (err instanceof PalisadeError) return err;
  const message = err instanceof Error ? err.message : String(err);
  const hint = isTransient(err) ? ' (the cluster did not answer in time: members down, or an election under way)' : '';
  return new LockServiceError('etcd', `${what} failed${hint}: ${message}`, err);
}
