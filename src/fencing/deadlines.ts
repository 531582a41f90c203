/**
 * Local deadlines on this process's monotonic clock (`performance.now()`):
 * a lease's expiry, a waiting attempt's cut-off. All of them share one
 * timer, armed for the earliest.
 *
 * Why not a `setTimeout` each: a lock cycle armed and cleared two of them,
 * and on a process busy with socket I/O that cost about 15 µs of client CPU
 * per timer, measured (a fifth of palisade's own share of a Redis cycle),
 * where a push onto a heap costs well under one. Most deadlines are
 * cancelled long before they fall (a lease released within its TTL), so a
 * cancel only marks its entry; the dead entries are swept out of the heap
 * when they outnumber the live ones.
 */
import { performance } from 'node:perf_hooks';

/** @internal A deadline that was scheduled: cancel it with {@link cancelDeadline}. */
export interface Deadline {
  readonly at: number;
  /** Cleared when the deadline fires or is cancelled. */
  fire: (() => void) | undefined;
  /** Whether it keeps the process alive until it fires or is cancelled. */
  readonly keepAlive: boolean;
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
 * otherwise not, as an unref'd one (a lease's expiry). `fire` runs from a
 * timer callback: it must not throw.
 */
export function atDeadline(at: number, fire: () => void, keepAlive = false): Deadline {
  const deadline: Deadline = { at, fire, keepAlive };
  scheduled++;
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
 * @internal For tests of leaks: deadlines scheduled so far (`scheduled`),
 * those neither fired nor cancelled (`live`), and the entries the heap holds
 * (`held`: live ones and cancelled ones not yet swept).
 */
export function deadlineCounts(): { scheduled: number; live: number; held: number } {
  return { scheduled, live: heap.length - cancelled, held: heap.length };
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
  try {
    while (heap.length > 0 && (heap[0] as Deadline).at <= now) {
      const due = pop();
      const fire = due.fire;
      if (fire === undefined) {
        cancelled--;
        continue;
      }
      settle(due);
      fire();
    }
  } finally {
    // Re-armed even when a callback threw (the throw is uncaught, as from any timer).
    dropCancelledHead();
    if (heap.length > 0 && (heap[0] as Deadline).at < armedAt) arm((heap[0] as Deadline).at);
  }
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

function push(d: Deadline): void {
  let i = heap.length;
  heap.push(d);
  while (i > 0) {
    const up = (i - 1) >> 1;
    const parent = heap[up] as Deadline;
    if (parent.at <= d.at) break;
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
    const child = right < heap.length && (heap[right] as Deadline).at < (heap[left] as Deadline).at ? right : left;
    if ((heap[child] as Deadline).at >= last.at) break;
    heap[i] = heap[child] as Deadline;
    i = child;
  }
  heap[i] = last;
  return top;
}
