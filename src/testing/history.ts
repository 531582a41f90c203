import { appendFileSync, readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';

/**
 * One line of an operation history, in the style of Jepsen: every operation
 * is recorded when invoked and again when it completes as `ok`, `fail` (it
 * certainly did not happen) or `unknown` (it may have happened: a timeout, a
 * killed process, a dropped connection).
 */
export interface HistoryEvent {
  /** Which worker process (a stable label, not the OS pid, which restarts change). */
  readonly process: string;
  readonly type: 'invoke' | 'ok' | 'fail' | 'unknown';
  /** `acquire`, `increment`, `release`, `probe` (an acquire after the faults stopped), … */
  readonly op: string;
  readonly lock?: string;
  /** The row written, for write operations. */
  readonly key?: string;
  /** Decimal string: fences exceed 2^53. */
  readonly fence?: string;
  readonly value?: number;
  /**
   * The fence source an `acquire`'s lease names (its lock's `source`), where it has one: the checker
   * holds the sources of one lock's grants to the order of their fences.
   */
  readonly source?: string;
  /** Which server granted an `acquire`, where the run has several (a Redis primary and replica). */
  readonly server?: string;
  /** Why a `fail`: `stale`, `duplicate`, `timeout`, … */
  readonly reason?: string;
  /** Milliseconds on a clock shared by the processes of one machine: `performance.timeOrigin + performance.now()`. */
  readonly time: number;
}

/** Current time on the history clock (comparable across processes of one machine, monotonic within one). */
export function historyTime(): number {
  return performance.timeOrigin + performance.now();
}

/**
 * Appends events to a JSON Lines file, synchronously so that a line written
 * before a SIGKILL is on disk. Each line is one `write` of under 4 KiB, so
 * lines from concurrent processes do not interleave (O_APPEND).
 */
export function historyRecorder(path: string, process: string) {
  return (event: Omit<HistoryEvent, 'process' | 'time'>): void => {
    appendFileSync(path, `${JSON.stringify({ process, time: historyTime(), ...event })}\n`);
  };
}

/** Reads a JSON Lines history; a torn last line (a process killed mid-write) is ignored. */
export function readHistory(path: string): HistoryEvent[] {
  const events: HistoryEvent[] = [];
  for (const line of readFileSync(path, 'utf8').split('\n')) {
    if (!line.trim()) continue;
    try {
      events.push(JSON.parse(line) as HistoryEvent);
    } catch {
      // torn line from a killed writer
    }
  }
  return events.sort((a, b) => a.time - b.time);
}
