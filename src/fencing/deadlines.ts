/**
 * Local deadlines on this process's monotonic clock (`performance.now()`):
 * a lease's expiry, a waiting attempt's cut-off. All of them share one
 * timer, armed for the earliest.
 *
 * Why not a `setTimeout` each: a lock cycle armed and cleared two of them,
 * and on a process busy with socket I/O a lease's timer cost about 15 µs of
 * client CPU per cycle, measured (bench/results/latest.md, section 2's
 * findings), where a push onto a heap costs well under one. Most deadlines are
 * cancelled long before they fall (a lease released within its TTL), so a
 * cancel only marks its entry; the dead entries are swept out of the heap
 * when they outnumber the live ones.
 *
 * Each deadline fires in the async context it was scheduled in (what its own
 * timer would have carried): a lease's `lost` listeners and abort handlers see
 * the request that acquired it, not whichever call last armed the shared timer.
 */
import { AsyncResource } from 'node:async_hooks';
import { performance } from 'node:perf_hooks';

/** @internal A deadline that was scheduled: cancel it with {@link cancelDeadline}. */
export interface Deadline {
  readonly at: number;
  /** Order of scheduling: deadlines at the same time fire in it. */
  readonly seq: number;
  /** Cleared when the deadline fires or is cancelled. */
  fire: (() => void) | undefined;
  /** Whether it keeps the process alive until it fires or is cancelled. */
  readonly keepAlive: boolean;
  /** The async context it was scheduled in, which it fires in. */
  readonly context: AsyncResource;
}

const heap: Deadline[] = [];
let cancelled = 0;
let scheduled = 0;
// Live deadlines that keep the process alive: the shared timer is ref'd only while there are some.
let keepingAlive = 0;
let timer: NodeJS.Timeout | undefined;
let armedAt = Number.POSITIVE_INFINITY;

/**
 * @internal Calls `fire` once, when `performance.now()` reaches `at` —
 * unless {@link cancelDeadline} came first. With `keepAlive` the deadline
 * keeps the process alive until then, as a ref'd timer would (a waiting
 * attempt: its cut-off must come even when nothing else is pending);
 * otherwise not, as an unref'd one (a lease's expiry). `fire` runs in the
 * async context of this call; if it throws, the error is uncaught (as from
 * a timer of its own), each error apart, once the other deadlines due with
 * it have fired. A deadline at +Infinity never fires (the timer is never
 * armed for it); NaN is refused.
 */
export function atDeadline(at: number, fire: () => void, keepAlive = false): Deadline {
  if (Number.isNaN(at)) throw new TypeError('a deadline must be a time, not NaN');
  // An AsyncResource, not AsyncResource.bind (which also defines properties on a new function).
  const context = new AsyncResource('palisade.deadline');
  const deadline: Deadline = { at, seq: scheduled++, fire, keepAlive, context };
  push(deadline);
  if (keepAlive && keepingAlive++ === 0) timer?.ref();
  if (at < armedAt) arm(at);
  return deadline;
}

/** @internal `deadline` will not fire. Safe to call more than once, and after it fired. */
export function cancelDeadline(deadline: Deadline | undefined): void {
  if (deadline?.fire === undefined) return;
  settle(deadline);
  cancelled++;
  if (cancelled > 64 && cancelled * 2 > heap.length) sweep();
}

// Fired or cancelled: it no longer fires, nor keeps the process alive.
function settle(deadline: Deadline): void {
  deadline.fire = undefined;
  if (deadline.keepAlive && --keepingAlive === 0) timer?.unref();
}

/**
 * @internal For tests of leaks: deadlines scheduled so far (`scheduled`);
 * of those scheduled since the first `since` of them, the ones neither fired
 * nor cancelled (`live`); the entries the heap holds (`held`: live ones and
 * cancelled ones not yet swept); and how many live ones keep the process
 * alive (`keepingAlive`).
 */
export function deadlineCounts(since = 0): { scheduled: number; live: number; held: number; keepingAlive: number } {
  const live = heap.reduce((n, d) => (d.fire !== undefined && d.seq >= since ? n + 1 : n), 0);
  return { scheduled, live, held: heap.length, keepingAlive };
}

function arm(at: number): void {
  if (timer !== undefined) clearTimeout(timer);
  armedAt = at;
  // +1: a Node timer may run a fraction of a millisecond before performance.now() reaches `at`.
  timer = setTimeout(expire, Math.max(0, at - performance.now()) + 1);
  if (keepingAlive === 0) timer.unref();
}

function expire(): void {
  timer = undefined;
  armedAt = Number.POSITIVE_INFINITY;
  const now = performance.now();
  while (heap.length > 0 && (heap[0] as Deadline).at <= now) {
    const due = pop();
    const fire = due.fire;
    if (fire === undefined) {
      cancelled--;
      continue;
    }
    settle(due);
    try {
      due.context.runInAsyncScope(fire);
    } catch (error) {
      // Uncaught, as from a timer of its own, but after this loop: the others due now still fire now.
      queueMicrotask(() => {
        throw error;
      });
    }
  }
  dropCancelledHead();
  if (heap.length > 0 && (heap[0] as Deadline).at < armedAt) arm((heap[0] as Deadline).at);
}

function dropCancelledHead(): void {
  while (heap.length > 0 && (heap[0] as Deadline).fire === undefined) {
    pop();
    cancelled--;
  }
}

// Rebuilt from the live entries: O(n), run at most once per n/2 cancels.
function sweep(): void {
  const live = heap.filter((d) => d.fire !== undefined);
  heap.length = 0;
  cancelled = 0;
  for (const d of live) push(d);
  if (heap.length === 0 && timer !== undefined) {
    clearTimeout(timer);
    timer = undefined;
    armedAt = Number.POSITIVE_INFINITY;
  }
}

// Earlier first; at the same time, scheduled first.
const before = (a: Deadline, b: Deadline): boolean => a.at < b.at || (a.at === b.at && a.seq < b.seq);

function push(d: Deadline): void {
  let i = heap.length;
  heap.push(d);
  while (i > 0) {
    const up = (i - 1) >> 1;
    const parent = heap[up] as Deadline;
    if (!before(d, parent)) break;
    heap[i] = parent;
    i = up;
  }
  heap[i] = d;
}

function pop(): Deadline {
  const top = heap[0] as Deadline;
  const last = heap.pop() as Deadline;
  if (heap.length === 0) return top;
  let i = 0;
  for (;;) {
    const left = 2 * i + 1;
    if (left >= heap.length) break;
    const right = left + 1;
    const child = right < heap.length && before(heap[right] as Deadline, heap[left] as Deadline) ? right : left;
    if (!before(heap[child] as Deadline, last)) break;
    heap[i] = heap[child] as Deadline;
    i = child;
  }
  heap[i] = last;
  return top;
}
