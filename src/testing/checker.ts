import type { HistoryEvent } from './history.js';

/**
 * One accepted write as the database recorded it: an audit row inserted in
 * the same transaction as the fenced write, *after* it — the fenced write
 * holds the row lock, so audit ids of one key follow commit order.
 */
export interface AuditRow {
  /** Increasing in insertion order (a bigserial). */
  readonly id: bigint | number | string;
  readonly key: string;
  readonly fence: bigint | number | string;
  readonly process: string;
  /**
   * The lock whose lease wrote, for writes made lock-scoped (`with(lease)`,
   * a fenced transaction). Rows that carry it are checked per lock too:
   * name the lock with its fence source, whose fences alone it compares.
   */
  readonly lock?: string | null;
}

/** What the checker is given besides the history. */
export interface CheckInput {
  readonly history: readonly HistoryEvent[];
  readonly audit: readonly AuditRow[];
  /** Final value of each counter row, by key. */
  readonly counters: Readonly<Record<string, number>>;
}

/** The checker's findings. `anomalies` empty means "no anomalies found" — not "proven safe". */
export interface Report {
  readonly ops: { ok: number; fail: number; unknown: number };
  readonly staleWrites: { attempted: number; rejected: number; accepted: number };
  /** Pairs of "I believe I hold it" intervals on one lock that overlapped in time: > 0 shows the faults bit. */
  readonly overlappingHolds: number;
  readonly fencesIssued: number;
  readonly anomalies: readonly string[];
}

/**
 * Checks a history of fenced counter increments against the audit trail:
 *
 * - per key, accepted fences strictly increase in commit order, so no write
 *   was accepted after a higher fence had been;
 * - per lock (audit rows with `lock`: lock-scoped writes), accepted fences
 *   never go down in commit order across all the lock's rows: no lock-scoped
 *   write was accepted after a higher fence of the same lock had claimed it;
 * - every accepted fence was issued (by an `acquire ok`) to the process that
 *   used it, and no fence was issued twice;
 * - per lock, the fence sources its grants name (`source` of `acquire ok`),
 *   in fence order, never go back to one left behind: a source id changes
 *   at one point of a counter's fences, so no two holders of one counter's
 *   fences fill two registers of one lock;
 * - each counter equals its acknowledged increments, within ok … ok + unknown,
 *   and equals its number of audit rows;
 * - after the faults stopped, every `probe` acquire (the runner bounds its wait
 *   by one TTL) succeeded.
 *
 * An operation invoked and never completed (its process was killed) counts
 * as `unknown`. `start`, `lost` and `nemesis` events are markers, not
 * operations.
 *
 * Like Jepsen's checkers it can find anomalies, not prove their absence.
 */
export function checkHistory(input: CheckInput): Report {
  const anomalies: string[] = [];
  const history = withCrashesResolved(input.history);
  const completions = history.filter((e) => e.type !== 'invoke' && !MARKERS.has(e.op));
  const ops = {
    ok: completions.filter((e) => e.type === 'ok').length,
    fail: completions.filter((e) => e.type === 'fail').length,
    unknown: completions.filter((e) => e.type === 'unknown').length,
  };

  // Fences issued, and to whom.
  const issuedTo = new Map<string, string>();
  for (const e of history) {
    if (e.op !== 'acquire' || e.type !== 'ok' || e.fence === undefined) continue;
    const owner = issuedTo.get(e.fence);
    if (owner !== undefined) anomalies.push(`fence ${e.fence} issued twice (to ${owner} and ${e.process})`);
    else issuedTo.set(e.fence, e.process);
  }

  anomalies.push(...sourcesOutOfOrder(history));

  // Commit order per key.
  const byKey = new Map<string, AuditRow[]>();
  for (const row of [...input.audit].sort((a, b) => compare(BigInt(a.id), BigInt(b.id)))) {
    const rows = byKey.get(row.key) ?? [];
    rows.push(row);
    byKey.set(row.key, rows);
  }
  let acceptedStale = 0;
  for (const [key, rows] of byKey) {
    let highest: bigint | undefined;
    for (const row of rows) {
      const fence = BigInt(row.fence);
      if (highest !== undefined && fence <= highest) {
        acceptedStale++;
        anomalies.push(`key ${key}: fence ${fence} accepted after fence ${highest} (audit id ${row.id})`);
      }
      if (highest === undefined || fence > highest) highest = fence;
      const owner = issuedTo.get(fence.toString());
      if (owner === undefined) anomalies.push(`key ${key}: accepted fence ${fence} was never issued`);
      else if (owner !== row.process)
        anomalies.push(`key ${key}: fence ${fence} issued to ${owner} but used by ${row.process}`);
    }
  }

  // Lock scope: per lock, across its rows. A lock-scoped write holds the lock's register from its claim
  // to its commit, and the audit row is inserted in between, so audit ids of one lock follow claim order.
  const highestByLock = new Map<string, bigint>();
  for (const row of [...input.audit].sort((a, b) => compare(BigInt(a.id), BigInt(b.id)))) {
    if (row.lock === undefined || row.lock === null) continue;
    const fence = BigInt(row.fence);
    const highest = highestByLock.get(row.lock);
    if (highest !== undefined && fence < highest) {
      acceptedStale++;
      anomalies.push(
        `lock ${row.lock}: fence ${fence} accepted on key ${row.key} after fence ${highest} claimed the lock (audit id ${row.id})`,
      );
    }
    if (highest === undefined || fence > highest) highestByLock.set(row.lock, fence);
  }

  // Counters against acknowledged increments.
  for (const [key, value] of Object.entries(input.counters)) {
    const incs = history.filter((e) => e.op === 'increment' && e.key === key);
    const ok = incs.filter((e) => e.type === 'ok').length;
    const unknown = incs.filter((e) => e.type === 'unknown').length;
    if (value < ok || value > ok + unknown) {
      anomalies.push(`key ${key}: counter ${value} outside acknowledged increments ${ok} … ${ok + unknown}`);
    }
    const audited = byKey.get(key)?.length ?? 0;
    if (audited !== value) anomalies.push(`key ${key}: counter ${value} but ${audited} audited writes`);
  }

  // Nothing wedged: a probe acquire per lock after the faults, whose waitMs the runner bounds by one TTL.
  const probes = history.filter((e) => e.op === 'probe' && e.type !== 'invoke');
  if (probes.length === 0)
    anomalies.push('no successful probe acquire (waiting at most one TTL) after the faults stopped');
  for (const probe of probes.filter((e) => e.type !== 'ok'))
    anomalies.push(`probe of lock ${probe.lock ?? '?'} failed (${probe.reason ?? 'no reason'}): a lock stayed wedged`);

  const rejected = history.filter((e) => e.op === 'increment' && e.type === 'fail' && e.reason === 'stale').length;
  return {
    ops,
    staleWrites: { attempted: rejected + acceptedStale, rejected, accepted: acceptedStale },
    overlappingHolds: countOverlaps(history),
    fencesIssued: issuedTo.size,
    anomalies,
  };
}

/**
 * Per lock, in fence order, a source named again after another was named: one counter's fences filed
 * under two sources at once (a grant that named an id its counter had left, say), where a stale holder's
 * lock-scoped write would claim a register the newer holder's never touched.
 */
function sourcesOutOfOrder(history: readonly HistoryEvent[]): string[] {
  const byLock = new Map<string, { fence: bigint; source: string }[]>();
  for (const e of history) {
    if (e.op !== 'acquire' || e.type !== 'ok' || e.fence === undefined || !e.source || !e.lock) continue;
    const grants = byLock.get(e.lock) ?? [];
    grants.push({ fence: BigInt(e.fence), source: e.source });
    byLock.set(e.lock, grants);
  }
  const found: string[] = [];
  for (const [lock, grants] of byLock) {
    const left = new Set<string>();
    let current: { fence: bigint; source: string } | undefined;
    for (const grant of grants.sort((a, b) => compare(a.fence, b.fence))) {
      if (current !== undefined && grant.source !== current.source) {
        if (left.has(grant.source))
          found.push(
            `lock ${lock}: fence ${grant.fence} names source ${grant.source} again, after fence ${current.fence} named ${current.source}`,
          );
        left.add(current.source);
      }
      current = grant;
    }
  }
  return found;
}

/**
 * Operations that are markers, not operations: `start` (a worker process
 * (re)started: it holds nothing), `lost` (a lease was observed lost),
 * `nemesis` (a fault injected). They end hold intervals but are not counted
 * as ok / failed / unknown.
 */
const MARKERS = new Set(['start', 'lost', 'nemesis']);

/**
 * An operation invoked but never completed — its process was killed, or
 * the history ends first — may or may not have taken effect: it counts as
 * `unknown`, as Jepsen treats a crashed operation. The synthetic completion
 * is placed just after the invocation's last sign of life (the process's
 * next event, or the end of the history).
 */
function withCrashesResolved(history: readonly HistoryEvent[]): HistoryEvent[] {
  const resolved: HistoryEvent[] = [...history];
  const pending = new Map<string, HistoryEvent>();
  const crash = (invoke: HistoryEvent, time: number) =>
    resolved.push({ ...invoke, type: 'unknown', reason: 'crashed', time });
  for (const e of history) {
    const open = pending.get(e.process);
    if (e.type === 'invoke') {
      if (open) crash(open, e.time);
      pending.set(e.process, e);
    } else if (open && (e.op === open.op || e.op === 'start')) {
      if (e.op === 'start') crash(open, e.time);
      pending.delete(e.process);
    }
  }
  const end = history.at(-1)?.time ?? 0;
  for (const open of pending.values()) crash(open, end);
  return resolved.sort((a, b) => a.time - b.time);
}

/** Hold intervals: from `acquire ok` to the holder's next `release` invoke, lease loss or end of its history. */
function countOverlaps(history: readonly HistoryEvent[]): number {
  const intervals: { lock: string; process: string; from: number; to: number }[] = [];
  const open = new Map<string, { lock: string; from: number }>();
  const last = history.at(-1)?.time ?? 0;
  for (const e of history) {
    if (e.op === 'acquire' && e.type === 'ok' && e.lock) open.set(e.process, { lock: e.lock, from: e.time });
    const ends = (e.op === 'release' && e.type === 'invoke') || e.op === 'lost' || e.op === 'start';
    const held = open.get(e.process);
    if (ends && held) {
      intervals.push({ lock: held.lock, process: e.process, from: held.from, to: e.time });
      open.delete(e.process);
    }
  }
  for (const [process, held] of open) intervals.push({ lock: held.lock, process, from: held.from, to: last });
  let overlaps = 0;
  for (let i = 0; i < intervals.length; i++) {
    for (let j = i + 1; j < intervals.length; j++) {
      const a = intervals[i] as (typeof intervals)[number];
      const b = intervals[j] as (typeof intervals)[number];
      if (a.lock === b.lock && a.process !== b.process && a.from < b.to && b.from < a.to) overlaps++;
    }
  }
  return overlaps;
}

/** A report as text, worded like Jepsen's: "no anomalies found", never "proven safe". */
export function formatReport(report: Report): string {
  const lines = [
    `operations: ${report.ops.ok} ok, ${report.ops.fail} failed, ${report.ops.unknown} unknown`,
    `fences issued: ${report.fencesIssued}`,
    `stale writes: ${report.staleWrites.attempted} attempted, ${report.staleWrites.rejected} rejected, ${report.staleWrites.accepted} accepted`,
    `overlapping "I hold it" intervals: ${report.overlappingHolds}`,
    report.anomalies.length === 0 ? 'no anomalies found' : `${report.anomalies.length} anomalies found:`,
    ...report.anomalies.slice(0, 50).map((a) => `  - ${a}`),
  ];
  return lines.join('\n');
}

function compare(a: bigint, b: bigint): number {
  return a < b ? -1 : a > b ? 1 : 0;
}
