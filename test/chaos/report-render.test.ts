/**
 * The chaos report's timeline from a hand-made history: leases end where
 * the checker says a hold ends, each write is one mark, and fault kinds the
 * page does not know (a new nemesis) still get a band and their name. The
 * page itself is opened in a real browser by the slow suite
 * (test-slow/chaos-report.test.ts).
 */
import { describe, expect, it } from 'vitest';
import { buildTimeline, fenceLabel, renderHtml } from '../../scripts/chaos-report/render.js';
import type { HistoryEvent } from '../../src/testing/history.js';

const at = (time: number, process: string, e: Omit<HistoryEvent, 'time' | 'process'>): HistoryEvent => ({
  time,
  process,
  ...e,
});

const history: HistoryEvent[] = [
  at(1000, 'w1', { type: 'ok', op: 'start' }),
  at(1000, 'w2', { type: 'ok', op: 'start' }),
  at(1010, 'w1', { type: 'ok', op: 'acquire', lock: 'L', fence: '1' }),
  at(1500, 'w2', { type: 'ok', op: 'acquire', lock: 'L', fence: '2' }), // w1 paused: both believe they hold L
  at(1600, 'w2', { type: 'ok', op: 'increment', key: 'c', fence: '2', value: 1 }),
  at(1650, 'w2', { type: 'invoke', op: 'release', lock: 'L', fence: '2' }),
  at(2000, 'w1', { type: 'fail', op: 'increment', key: 'c', fence: '1', reason: 'stale' }),
  at(2010, 'w1', { type: 'invoke', op: 'release', lock: 'L', fence: '1' }),
  at(2100, 'w3', { type: 'ok', op: 'start' }),
  at(2200, 'w3', { type: 'fail', op: 'increment', key: 'c', fence: '3', reason: 'duplicate' }),
  at(2300, 'probe', { type: 'ok', op: 'probe', lock: 'L', fence: '4' }),
];
const nemesis: HistoryEvent[] = [
  at(1100, 'nemesis', { type: 'ok', op: 'nemesis', reason: 'pause: w1 (holding fence 1) for 800 ms' }),
  at(1700, 'nemesis', { type: 'ok', op: 'nemesis', reason: 'failover: replica promoted' }),
  at(1800, 'nemesis', { type: 'ok', op: 'nemesis', reason: 'quake: something new' }),
];

describe('chaos report timeline', () => {
  const t = buildTimeline(history, nemesis);

  it('one lane per worker (not the nemesis or the probe), leases as the checker sees holds, one overlap', () => {
    expect(t.lanes).toEqual(['w1', 'w2', 'w3']);
    expect(t.holds.map((h) => [h.process, h.fence, h.from, h.to, h.end])).toEqual([
      ['w2', '2', 1500, 1650, 'released'],
      ['w1', '1', 1010, 2010, 'released'],
    ]);
    expect(t.overlaps.map((o) => [o.from, o.to])).toEqual([[1500, 1650]]);
    expect(t.writes.map((w) => w.outcome)).toEqual(['applied', 'stale', 'other']);
  });

  it('faults: a stated duration, and unknown kinds kept with their name', () => {
    expect(t.faults.map((f) => [f.kind, f.to - f.from])).toEqual([
      ['pause', 800],
      ['failover', 150],
      ['quake', 150],
    ]);
    const html = renderHtml(t, undefined, history);
    expect([...html.matchAll(/<g class="write write-refused"/g)].length).toBe(1);
    expect(html).toContain('<g class="fault fault-failover" data-kind="failover">');
    expect(
      renderHtml(
        { ...t, faults: [{ ...(t.faults[0] as (typeof t.faults)[number]), kind: 'partition' }] },
        undefined,
        history,
      ),
    ).toContain('<g class="fault fault-partition" data-kind="partition">');
    expect(html).toContain('<g class="fault fault-other" data-kind="quake">');
    expect(html).toMatch(/<text class="fault-label"[^>]*>quake<\/text>/);
    expect(html).not.toMatch(/<(script|link|img)[^>]+(src|href)=/); // self-contained: nothing fetched
  });

  it('labels a Redis fence as epoch.counter and a small fence as itself', () => {
    expect(fenceLabel(((3n << 39n) | 17n).toString())).toBe('3.17');
    expect(fenceLabel('42')).toBe('42');
  });

  // Regression: a 10-minute replication run (over 180,000 events) overflowed the call stack in Math.min(...times).
  it('a long run: the time range of 300,000 events', () => {
    const many: HistoryEvent[] = [];
    for (let i = 0; i < 300_000; i++) many.push(at(5_000 + i, `w${i % 4}`, { type: 'ok', op: 'start' }));
    const long = buildTimeline(many, nemesis);
    expect([long.start, long.end]).toEqual([1100, 304_999]);
  });
});
