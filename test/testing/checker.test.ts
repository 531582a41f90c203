import { describe, expect, it } from 'vitest';
import { type AuditRow, checkHistory, formatReport, type HistoryEvent } from '../../src/testing/index.js';

let clock = 0;
const ev = (
  process: string,
  type: HistoryEvent['type'],
  op: string,
  extra: Partial<HistoryEvent> = {},
): HistoryEvent => ({
  process,
  type,
  op,
  time: ++clock,
  ...extra,
});

/** Two workers on lock L: w1 gets fence 1, pauses; w2 gets fence 2 and increments; w1's late write is refused. */
function cleanRun(): { history: HistoryEvent[]; audit: AuditRow[] } {
  const history = [
    ev('w1', 'invoke', 'acquire', { lock: 'L' }),
    ev('w1', 'ok', 'acquire', { lock: 'L', fence: '1' }),
    ev('w2', 'invoke', 'acquire', { lock: 'L' }),
    ev('w2', 'ok', 'acquire', { lock: 'L', fence: '2' }),
    ev('w2', 'invoke', 'increment', { key: 'c', fence: '2' }),
    ev('w2', 'ok', 'increment', { key: 'c', fence: '2' }),
    ev('w1', 'invoke', 'increment', { key: 'c', fence: '1' }),
    ev('w1', 'fail', 'increment', { key: 'c', fence: '1', reason: 'stale' }),
    ev('w2', 'invoke', 'release', { lock: 'L' }),
    ev('w2', 'ok', 'release', { lock: 'L' }),
    ev('w1', 'invoke', 'release', { lock: 'L' }),
    ev('w1', 'ok', 'release', { lock: 'L' }),
    ev('probe', 'invoke', 'probe', { lock: 'L' }),
    ev('probe', 'ok', 'probe', { lock: 'L', fence: '3' }),
  ];
  return { history, audit: [{ id: 1, key: 'c', fence: '2', process: 'w2' }] };
}

describe('checkHistory', () => {
  it('finds no anomalies in a run where the stale write was refused, and sees the overlap', () => {
    const report = checkHistory({ ...cleanRun(), counters: { c: 1 } });
    expect(report.anomalies).toEqual([]);
    expect(report.staleWrites).toEqual({ attempted: 1, rejected: 1, accepted: 0 });
    expect(report.overlappingHolds).toBe(1);
    expect(report.fencesIssued).toBe(2);
    expect(formatReport(report)).toContain('no anomalies found');
  });

  it('reports a lower fence accepted after a higher one', () => {
    const run = cleanRun();
    const audit = [...run.audit, { id: 2, key: 'c', fence: '1', process: 'w1' }];
    const report = checkHistory({ history: run.history, audit, counters: { c: 2 } });
    expect(report.staleWrites.accepted).toBe(1);
    expect(report.anomalies.join('\n')).toMatch(/fence 1 accepted after fence 2/);
  });

  it('lock scope: reports a lower fence accepted on an untouched row after a higher fence of the same lock', () => {
    const run = cleanRun();
    const history = [
      ...run.history,
      ev('w1', 'invoke', 'increment', { key: 'd', fence: '1' }),
      ev('w1', 'ok', 'increment', { key: 'd', fence: '1' }),
    ];
    // w2 (fence 2) wrote c under lock L; w1 (fence 1) then wrote d, which w2 never touched.
    const scoped: AuditRow[] = [
      { id: 1, key: 'c', fence: '2', process: 'w2', lock: 'ns/L' },
      { id: 2, key: 'd', fence: '1', process: 'w1', lock: 'ns/L' },
    ];
    const report = checkHistory({ history, audit: scoped, counters: { c: 1, d: 1 } });
    expect(report.anomalies.join('\n')).toMatch(/lock ns\/L: fence 1 accepted on key d after fence 2 claimed the lock/);
    expect(report.staleWrites.accepted).toBe(1);
    // Row-scoped rows (no lock) are checked per key only: the same audit is clean there.
    const rowScoped = scoped.map(({ lock: _lock, ...row }) => row);
    expect(checkHistory({ history, audit: rowScoped, counters: { c: 1, d: 1 } }).anomalies).toEqual([]);
    // Two rows of one critical section carry one fence: equal fences are fine.
    const same: AuditRow[] = [
      { id: 1, key: 'c', fence: '2', process: 'w2', lock: 'ns/L' },
      { id: 2, key: 'd', fence: '2', process: 'w2', lock: 'ns/L' },
    ];
    const both = [
      ...run.history,
      ev('w2', 'invoke', 'increment', { key: 'd', fence: '2' }),
      ev('w2', 'ok', 'increment', { key: 'd', fence: '2' }),
    ];
    expect(checkHistory({ history: both, audit: same, counters: { c: 1, d: 1 } }).anomalies).toEqual([]);
  });

  it("fence sources: reports a lock's grants naming a source again after another, in fence order", () => {
    const grant = (process: string, fence: string, source: string) => [
      ev(process, 'invoke', 'acquire', { lock: 'L' }),
      ev(process, 'ok', 'acquire', { lock: 'L', fence, source }),
    ];
    const check = (history: HistoryEvent[]) => checkHistory({ history, audit: [], counters: {} }).anomalies;
    // An id changed once: fences 1–2 under s1, 3–4 under s2 (the order of the events does not matter, fences do).
    const changed = [...grant('w2', '3', 's2'), ...grant('w1', '1', 's1'), ...grant('w1', '2', 's1')];
    const probe = [ev('probe', 'invoke', 'probe', { lock: 'L' }), ev('probe', 'ok', 'probe', { lock: 'L' })];
    expect(check([...changed, ...grant('w2', '4', 's2'), ...probe])).toEqual([]);
    // A manager that kept the old id after the change: two registers of one lock filled at once.
    const stuck = check([...changed, ...grant('w1', '4', 's1'), ...probe]);
    expect(stuck).toEqual(['lock L: fence 4 names source s1 again, after fence 3 named s2']);
    // Grants without a source (a backend whose leases name none) are not judged.
    expect(check([...grant('w1', '1', ''), ...grant('w2', '2', 's1'), ...grant('w1', '3', ''), ...probe])).toEqual([]);
  });

  it('reports a fence issued twice and a fence used by a process it was not issued to', () => {
    const run = cleanRun();
    const history = [...run.history, ev('w3', 'ok', 'acquire', { lock: 'L', fence: '2' })];
    const audit = [{ id: 1, key: 'c', fence: '2', process: 'w1' }];
    const anomalies = checkHistory({ history, audit, counters: { c: 1 } }).anomalies.join('\n');
    expect(anomalies).toMatch(/fence 2 issued twice/);
    expect(anomalies).toMatch(/issued to w2 but used by w1/);
  });

  it('reports a counter outside the acknowledged increments, and an unaudited change', () => {
    const report = checkHistory({ ...cleanRun(), counters: { c: 3 } });
    expect(report.anomalies.join('\n')).toMatch(/counter 3 outside acknowledged increments 1 … 1/);
    expect(report.anomalies.join('\n')).toMatch(/counter 3 but 1 audited writes/);
  });

  it('accepts a counter within ok … ok + unknown', () => {
    const run = cleanRun();
    const history = [
      ...run.history,
      ev('w2', 'invoke', 'increment', { key: 'c', fence: '2' }),
      ev('w2', 'unknown', 'increment', { key: 'c' }),
    ];
    expect(checkHistory({ history, audit: run.audit, counters: { c: 1 } }).anomalies).toEqual([]);
  });

  it('reports a wedged lock: no successful probe', () => {
    const run = cleanRun();
    const history = run.history.filter((e) => e.op !== 'probe');
    expect(checkHistory({ history, audit: run.audit, counters: { c: 1 } }).anomalies).toContain(
      'no successful probe acquire (waiting at most one TTL) after the faults stopped',
    );
  });

  it('counts an increment whose process was killed before it completed as unknown', () => {
    const run = cleanRun();
    const history = [
      ...run.history,
      ev('w2', 'invoke', 'acquire', { lock: 'L' }),
      ev('w2', 'ok', 'acquire', { lock: 'L', fence: '4' }),
      ev('w2', 'invoke', 'increment', { key: 'c', fence: '4' }),
      // kill -9: no completion; the restarted process starts afresh.
      ev('w2', 'ok', 'start'),
    ];
    const report = checkHistory({ history, audit: run.audit, counters: { c: 1 } });
    expect(report.anomalies).toEqual([]);
    expect(report.ops.unknown).toBe(1);
    // The crashed increment may have committed: a counter of 2 is within ok … ok + unknown, but the audit must agree.
    const audit = [...run.audit, { id: 2, key: 'c', fence: '4', process: 'w2' }];
    expect(checkHistory({ history, audit, counters: { c: 2 } }).anomalies).toEqual([]);
    // Had the increment completed as refused, the same counter would be an anomaly.
    const refused = [...history.slice(0, -1), ev('w2', 'fail', 'increment', { key: 'c', fence: '4', reason: 'stale' })];
    expect(checkHistory({ history: refused, audit, counters: { c: 2 } }).anomalies.join('\n')).toMatch(
      /counter 2 outside acknowledged increments 1 … 1/,
    );
  });

  it('does not count start / lost / nemesis markers as operations, but ends hold intervals with them', () => {
    const run = cleanRun();
    const history = [
      ...run.history,
      ev('nemesis', 'ok', 'nemesis', { reason: 'pause w1' }),
      ev('w1', 'ok', 'lost', { lock: 'L' }),
      ev('w1', 'ok', 'start'),
    ];
    const report = checkHistory({ history, audit: run.audit, counters: { c: 1 } });
    expect(report.ops).toEqual(checkHistory({ ...run, counters: { c: 1 } }).ops);
    expect(report.overlappingHolds).toBe(1);
  });
});
