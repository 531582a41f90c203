import { isDeepStrictEqual } from 'node:util';
import type { Fence } from '../fencing/fence.js';
import type { LockManager } from '../fencing/lock-manager.js';
import type { WriteResult } from '../repo/result.js';

/** Options of {@link assertStaleWriteRefused}. */
export interface StaleWriteScenario {
  readonly manager: LockManager;
  /** A lock name no one else uses during the check. */
  readonly lock: string;
  /** Short, so the check is quick: the first holder is "paused" until its lease is gone. */
  readonly ttlMs: number;
  /** Your protected write, carrying `fence` to your fenced repository. Called once per holder. */
  readonly write: (fence: Fence, holder: 'first' | 'second') => Promise<WriteResult<unknown>>;
  /**
   * Optional: reads back what `write` protects (a row, several, a count).
   * Then the check also fails when the late write reported `stale` but
   * changed what `read` returns — a write path that writes something
   * unfenced before or beside its fenced write. Without it only the
   * reported result is judged.
   */
  readonly read?: () => Promise<unknown>;
}

/** What happened, for further assertions of your own. */
export interface StaleWriteOutcome {
  readonly firstFence: Fence;
  readonly secondFence: Fence;
  readonly second: WriteResult<unknown>;
  readonly late: WriteResult<unknown>;
}

/**
 * Plays the paused-holder scenario (the README's demo) against your own repository, in-process:
 * holder 1 acquires and then "pauses" (does nothing) until its lease is gone;
 * holder 2 acquires a higher fence and writes; holder 1 resumes and writes
 * with its old fence. Throws unless holder 2's write applied and holder 1's
 * late write was refused (`stale`) and, with `read`, left what it reads
 * unchanged.
 *
 * Proves your write path is fenced for this one interleaving; it does not
 * pause a real process (see the chaos runner for that) or prove safety in
 * general.
 */
export async function assertStaleWriteRefused(scenario: StaleWriteScenario): Promise<StaleWriteOutcome> {
  const { manager, lock, ttlMs, write } = scenario;
  const first = await manager.acquire(lock, { ttlMs, holder: 'first (will pause)' });
  // The pause: the first holder neither extends nor releases. Its local
  // deadline fires no earlier than the TTL measured from before the grant.
  await new Promise<void>((resolve) => first.signal.addEventListener('abort', () => resolve(), { once: true }));
  const second = await manager.acquire(lock, {
    ttlMs: Math.max(ttlMs, 1000),
    waitMs: ttlMs * 20 + 5000,
    holder: 'second',
  });
  try {
    if (second.fence <= first.fence) {
      throw new Error(`fences did not increase: second ${second.fence} <= first ${first.fence}`);
    }
    const secondResult = await write(second.fence, 'second');
    if (secondResult.status !== 'applied')
      throw new Error(`the second holder's write did not apply: ${secondResult.status}`);
    const before = scenario.read ? await scenario.read() : undefined;
    const late = await write(first.fence, 'first');
    if (late.status !== 'stale') {
      throw new Error(`the paused holder's late write was not refused as stale: ${late.status} — is the write fenced?`);
    }
    if (scenario.read && !isDeepStrictEqual(await scenario.read(), before)) {
      // No values in the message: they are the caller's data.
      throw new Error(
        "the paused holder's late write was reported stale but changed what read() returns — is all of the write fenced?",
      );
    }
    return { firstFence: first.fence, secondFence: second.fence, second: secondResult, late };
  } finally {
    await second.release();
    await first.release();
  }
}
