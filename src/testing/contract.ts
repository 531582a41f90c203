/**
 * The lock backend contract suite: what every {@link LockBackend} must do for
 * `createLockManager` to keep its promises. The README's "Writing a lock
 * backend" section is the manual.
 */
import type { LockBackend } from '../fencing/backend.js';
import type { LockManagerHooks } from '../fencing/lock-manager.js';
import {
  checkBadInputRefused,
  checkIdempotentGrant,
  checkIncreasingFences,
  checkInspect,
  checkLateRelease,
  checkReleaseWakesWaiter,
  checkTokenChecked,
} from './contract-checks.js';
import { checkLockIdentityCarried } from './contract-identity.js';
import { checkNoOverlapAcrossProcesses } from './contract-process.js';

/** The few assertions the suite makes: vitest's and jest's `expect` fit. */
export type ContractExpect = (actual: unknown) => {
  toBe(expected: unknown): void;
  toEqual(expected: unknown): void;
};

/** The test runner's functions the suite registers its checks with (vitest, jest, or a runner of the same shape). */
export interface ContractRunner {
  readonly describe: (name: string, body: () => void) => unknown;
  /** Called as `it(name, fn, timeoutMs)`. */
  readonly it: (name: string, fn: () => Promise<void>, timeoutMs?: number) => unknown;
  readonly expect: ContractExpect;
}

/** One backend under test, opened by {@link LockBackendContract.open}. */
export interface ContractSubject {
  readonly backend: LockBackend;
  /** What the backend's client adds to the manager's errors (as given to `createLockManager`). */
  readonly hooks?: LockManagerHooks;
  /**
   * JSON-serialisable options the worker module's `openBackend` turns into a
   * backend on the same store and namespace, in another OS process.
   */
  readonly processOptions: unknown;
  /**
   * Makes the current holder of `name` lose it the way this backend loses
   * leases, for a backend whose leases do not expire by TTL (advisory locks:
   * end the holder's session). Absent: the suite waits (bounded) for the
   * TTL to run out.
   */
  loseLease?(name: string): Promise<void>;
  /** Frees everything `open` made: clients, the namespace's keys or rows. */
  dispose(): Promise<void>;
}

/**
 * How the suite gets backends. Every call of `open` must give a backend in
 * a namespace no other call uses, so checks run in parallel and twice.
 * An options object, so that what later versions of the contract need can
 * be added without breaking contracts written against this one.
 */
export interface LockBackendContract {
  open(): Promise<ContractSubject>;
  /**
   * For the check that needs other OS processes: an absolute path (or
   * `file:` URL) of a module exporting
   * `openBackend(options: unknown): Promise<{ backend: LockBackend; hooks?: LockManagerHooks; close(): Promise<void> }>`,
   * called with a subject's `processOptions`. The suite runs it with
   * `node --import tsx` (or `execArgv`).
   */
  readonly processModule: string;
  /** Node flags for the worker processes. Default: `['--import', 'tsx']`. */
  readonly execArgv?: readonly string[];
  /** The TTL the checks grant with, in ms (≥ 1000; default 10,000). The late-release check uses 1,000 ms. */
  readonly ttlMs?: number;
  /** Per-check timeout handed to `it`, in ms. Default 120,000. */
  readonly timeoutMs?: number;
}

/**
 * Registers the contract's checks for a backend under `describe(name)`:
 * idempotent grants per token, token-checked release and extend, late
 * release after expiry, no overlap across OS processes, 1,000 grants with
 * strictly increasing fences, release wakes a waiter, bad input refused
 * before any round trip, inspect, and the lock identity (a backend that
 * declares `namespace` gives every grant the same non-empty `source`, and
 * its leases a `lock`). Each check opens and disposes its own
 * subject.
 *
 * Guarantees: every loop it runs is bounded in count and time, and it
 * asserts events and orders, never durations. Does not: prove fencing at
 * the resource (run `assertStaleWriteRefused` for that) nor any
 * backend-specific fault (a restart, a failover): test those beside it.
 */
export function describeLockBackend(name: string, runner: ContractRunner, contract: LockBackendContract): void {
  const { describe, it, expect } = runner;
  const timeout = contract.timeoutMs ?? 120_000;
  const ttlMs = contract.ttlMs ?? 10_000;
  const check = (title: string, body: (subject: ContractSubject) => Promise<void>) =>
    it(
      title,
      async () => {
        const subject = await contract.open();
        try {
          await body(subject);
        } finally {
          await subject.dispose();
        }
      },
      timeout,
    );
  describe(`${name}: lock backend contract`, () => {
    check('a re-sent grant with the same token returns the same fence; another token is refused', (s) =>
      checkIdempotentGrant(s, expect, ttlMs),
    );
    check('release and extend check the token: a wrong token never frees or extends the lock', (s) =>
      checkTokenChecked(s, expect, ttlMs),
    );
    check('a late release after expiry reports the lease lost and never touches the new holder', (s) =>
      checkLateRelease(s, expect, ttlMs),
    );
    check('critical sections of several OS processes never overlap, and enter in fence order', (s) =>
      checkNoOverlapAcrossProcesses(s, expect, contract, ttlMs),
    );
    check('1,000 grants carry strictly increasing fences', (s) => checkIncreasingFences(s, expect, ttlMs));
    check('a release wakes a waiter before its wait runs out', (s) => checkReleaseWakesWaiter(s, expect, ttlMs));
    check('bad input is refused with InvalidArgumentError before any round trip', (s) =>
      checkBadInputRefused(s, expect),
    );
    check('inspect reports the holder and fence while held, and null once released', (s) =>
      checkInspect(s, expect, ttlMs),
    );
    check('with a namespace, every grant names one fence source and leases carry their lock', (s) =>
      checkLockIdentityCarried(s, expect, ttlMs),
    );
  });
}
