/**
 * Leak checks for the timers and local deadlines of leases: what was
 * created from a point on, and what of it is still pending.
 */
import { createHook } from 'node:async_hooks';
import { deadlineCounts } from '../../src/fencing/deadlines.js';

export interface TimerTracker {
  /** Timers created and local deadlines scheduled since the tracker started. */
  created(): number;
  /**
   * Where each timer still pending was created, and one line for the local
   * deadlines scheduled since the start that neither fired nor were cancelled.
   */
  pending(): Promise<string[]>;
  stop(): void;
}

/**
 * Follows every timer created from now on, ref'd or not (a lease's timers
 * are unref'd, so `process.getActiveResourcesInfo()` does not list them),
 * whose creation stack passes through `from` (every timer when omitted), and
 * the local deadlines of src/fencing/deadlines.ts. The one timer those
 * deadlines share is not counted: it outlives the leases by design and stops
 * by itself once the earliest cancelled deadline falls.
 */
export function trackTimers(from?: string): TimerTracker {
  const live = new Map<number, string>();
  let timers = 0;
  const since = deadlineCounts().scheduled;
  const limit = Error.stackTraceLimit;
  const hook = createHook({
    init(id, type) {
      if (type !== 'Timeout') return;
      Error.stackTraceLimit = 40;
      const stack = new Error().stack ?? '';
      Error.stackTraceLimit = limit;
      if ((from !== undefined && !stack.includes(from)) || stack.includes('/src/fencing/deadlines.')) return;
      timers++;
      const lines = stack.split('\n').slice(2);
      live.set(id, (from === undefined ? lines[0] : lines.find((line) => line.includes(from)))?.trim() ?? '');
    },
    destroy(id) {
      live.delete(id);
    },
  }).enable();
  return {
    created: () => timers + deadlineCounts().scheduled - since,
    async pending() {
      // Destroy hooks run asynchronously after a timer is cleared.
      for (let i = 0; i < 3; i++) await new Promise((r) => setImmediate(r));
      const deadlines = deadlineCounts(since).live;
      return [
        ...live.values(),
        ...(deadlines > 0 ? [`${deadlines} local deadline(s) neither fired nor cancelled`] : []),
      ];
    },
    stop: () => hook.disable(),
  };
}
