/**
 * Renders a chaos run's saved history as one self-contained HTML page
 * (`report.html`): no network, no library — hand-written SVG and a few
 * lines of inline script. One lane per worker with each lease (fence
 * labelled), the nemesis' faults as bands, every write as a mark (applied,
 * or refused as stale in red), the overlaps the locks allowed, and the
 * checker's verdict at the top.
 *
 * Input: `history.jsonl` and `nemesis.jsonl` (src/testing/history.ts) and,
 * when the run saved it, `report.json` (the checker's report and the run's
 * settings). Without `report.json` the verdict is judged from the history
 * alone (no audit table), and the page says so.
 */
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { checkHistory, type Report } from '../../src/testing/checker.js';
import { type HistoryEvent, readHistory } from '../../src/testing/history.js';

/** What `npm run chaos` saves beside the history for the renderer. */
export interface SavedReport {
  readonly report: Report;
  /** The run's settings and faults, one line each, as printed. */
  readonly summary: readonly string[];
  readonly ok: boolean;
}

/** One lease as a worker believed it held it. */
export interface Hold {
  readonly process: string;
  readonly lock: string;
  readonly fence: string;
  readonly from: number;
  readonly to: number;
  readonly end: 'released' | 'lost' | 'crashed' | 'end';
}

/** One write as the history recorded its completion. */
export interface WriteMark {
  readonly process: string;
  readonly time: number;
  readonly fence: string;
  /** `other`: refused for another reason (duplicate, missing, an error). */
  readonly outcome: 'applied' | 'stale' | 'other' | 'unknown';
  readonly reason: string | undefined;
}

/** One fault the nemesis injected. */
export interface Fault {
  readonly kind: string;
  readonly detail: string;
  readonly from: number;
  readonly to: number;
}

/** Everything the page shows, derived from the saved files. */
export interface Timeline {
  readonly start: number;
  readonly end: number;
  readonly lanes: readonly string[];
  readonly holds: readonly Hold[];
  readonly writes: readonly WriteMark[];
  readonly faults: readonly Fault[];
  /** Pairs of holds of one lock by two workers that overlap in time: what the locks allowed. */
  readonly overlaps: readonly { a: Hold; b: Hold; from: number; to: number }[];
}

const KNOWN_FAULTS = new Set([
  'pause',
  'partition',
  'kill',
  'terminate',
  'flush',
  'restart',
  'failover',
  'failback',
  'resync',
  'promote',
]);
const NOT_WORKERS = new Set(['nemesis', 'probe']);
/** Faults without a stated duration still get a visible band. */
const MIN_FAULT_MS = 150;

/** Builds the timeline from a history and the nemesis' log (either may mention the faults; each is shown once). */
export function buildTimeline(history: readonly HistoryEvent[], nemesis: readonly HistoryEvent[]): Timeline {
  const events = history.filter((e) => e.op !== 'nemesis');
  const faultEvents = nemesis.length > 0 ? nemesis : history.filter((e) => e.op === 'nemesis');
  const all = [...events, ...faultEvents];
  // A loop, not Math.min(...times): a long run has more events than the call stack has room for arguments.
  let start = Number.POSITIVE_INFINITY;
  let end = Number.NEGATIVE_INFINITY;
  for (const e of all) {
    if (e.time < start) start = e.time;
    if (e.time > end) end = e.time;
  }

  const lanes = [...new Set(events.map((e) => e.process).filter((p) => !NOT_WORKERS.has(p)))].sort(naturalOrder);

  const holds: Hold[] = [];
  const open = new Map<string, { lock: string; fence: string; from: number }>();
  for (const e of events) {
    if (e.op === 'acquire' && e.type === 'ok' && e.lock && e.fence !== undefined) {
      open.set(e.process, { lock: e.lock, fence: e.fence, from: e.time });
      continue;
    }
    const held = open.get(e.process);
    if (!held) continue;
    const endKind =
      e.op === 'release' && e.type === 'invoke'
        ? 'released'
        : e.op === 'lost'
          ? 'lost'
          : e.op === 'start'
            ? 'crashed'
            : undefined;
    if (endKind) {
      holds.push({ process: e.process, ...held, to: e.time, end: endKind });
      open.delete(e.process);
    }
  }
  for (const [process, held] of open) holds.push({ process, ...held, to: end, end: 'end' });

  const writes: WriteMark[] = events
    .filter((e) => e.op === 'increment' && e.type !== 'invoke')
    .map((e) => ({
      process: e.process,
      time: e.time,
      fence: e.fence ?? '?',
      outcome:
        e.type === 'ok' ? 'applied' : e.type === 'unknown' ? 'unknown' : e.reason === 'stale' ? 'stale' : 'other',
      reason: e.reason,
    }));

  const faults: Fault[] = faultEvents.map((e) => {
    const text = e.reason ?? '';
    const cut = text.indexOf(':');
    const kind = (cut > 0 ? text.slice(0, cut) : text).trim() || 'fault';
    const detail = cut > 0 ? text.slice(cut + 1).trim() : '';
    const stated = /\bfor (\d+) ?ms\b/.exec(detail);
    let to = e.time + (stated ? Number(stated[1]) : MIN_FAULT_MS);
    // A killed worker is down until it starts again.
    const killed = kind === 'kill' ? /^(\S+)/.exec(detail)?.[1] : undefined;
    if (killed) {
      const back = events.find((x) => x.process === killed && x.op === 'start' && x.time > e.time);
      if (back) to = Math.max(to, back.time);
    }
    return { kind, detail, from: e.time, to };
  });

  const overlaps: Timeline['overlaps'][number][] = [];
  for (let i = 0; i < holds.length; i++) {
    for (let j = i + 1; j < holds.length; j++) {
      const a = holds[i] as Hold;
      const b = holds[j] as Hold;
      if (a.lock === b.lock && a.process !== b.process && a.from < b.to && b.from < a.to) {
        overlaps.push({ a, b, from: Math.max(a.from, b.from), to: Math.min(a.to, b.to) });
      }
    }
  }
  return { start, end, lanes, holds, writes, faults, overlaps };
}

/** Reads a chaos run's directory and writes `report.html` there; returns its path. */
export function renderChaosReport(outDir: string): string {
  const history = readHistory(join(outDir, 'history.jsonl'));
  const nemesisPath = join(outDir, 'nemesis.jsonl');
  const nemesis = existsSync(nemesisPath) ? readHistory(nemesisPath) : [];
  const savedPath = join(outDir, 'report.json');
  const saved: SavedReport | undefined = existsSync(savedPath)
    ? (JSON.parse(readFileSync(savedPath, 'utf8')) as SavedReport)
    : undefined;
  const path = join(outDir, 'report.html');
  writeFileSync(path, renderHtml(buildTimeline(history, nemesis), saved, history));
  return path;
}

const esc = (s: string) =>
  s.replaceAll('&', '&amp;').replaceAll('<', '&lt;').replaceAll('>', '&gt;').replaceAll('"', '&quot;');

/** A Redis fence (epoch above bit 39) reads better as epoch.counter; a small fence as itself. */
export function fenceLabel(fence: string): string {
  if (!/^\d+$/.test(fence)) return fence;
  const f = BigInt(fence);
  const epoch = f >> 39n;
  return epoch > 0n ? `${epoch}.${f & ((1n << 39n) - 1n)}` : fence;
}

/** The whole page. */
export function renderHtml(t: Timeline, saved: SavedReport | undefined, history: readonly HistoryEvent[]): string {
  const report = saved?.report ?? checkHistory({ history, audit: [], counters: {} });
  const fromHistoryOnly = saved === undefined;
  const ok = report.anomalies.length === 0;
  const staleInHistory = t.writes.filter((w) => w.outcome === 'stale').length;

  // Geometry: time runs left to right; one lane per worker below the fault strip.
  const durationMs = Math.max(1, t.end - t.start);
  const pxPerMs = Math.min(0.12, Math.max(0.02, 1400 / durationMs));
  const left = 70;
  const laneH = 46;
  const faultH = 34;
  const top = 24 + faultH;
  const width = Math.ceil(left + durationMs * pxPerMs + 30);
  const height = top + t.lanes.length * laneH + 30;
  const x = (time: number) => left + (time - t.start) * pxPerMs;
  const laneY = (process: string) => top + t.lanes.indexOf(process) * laneH;

  const parts: string[] = [];
  // Time axis: a tick per second (or per 10 s on long runs).
  const stepMs = durationMs > 120_000 ? 10_000 : durationMs > 30_000 ? 5_000 : 1_000;
  for (let ms = 0; ms <= durationMs; ms += stepMs) {
    parts.push(
      `<line class="tick" x1="${x(t.start + ms)}" x2="${x(t.start + ms)}" y1="18" y2="${height - 24}"/>`,
      `<text class="tick-label" x="${x(t.start + ms)}" y="${height - 10}">${ms / 1000} s</text>`,
    );
  }
  // Faults: bands across every lane, named in the strip above them.
  const labelRows = [0, 0, 0]; // where the last label of each row ends, so names do not overprint
  for (const f of t.faults) {
    const row = Math.max(
      0,
      labelRows.findIndex((end) => end <= x(f.from)),
    );
    labelRows[row] = x(f.from) + f.kind.length * 7 + 6;
    const cls = KNOWN_FAULTS.has(f.kind) ? `fault fault-${f.kind}` : 'fault fault-other';
    const w = Math.max(2, (f.to - f.from) * pxPerMs);
    parts.push(
      `<g class="${cls}" data-kind="${esc(f.kind)}"><title>${esc(`${f.kind}: ${f.detail} (at ${((f.from - t.start) / 1000).toFixed(2)} s)`)}</title>` +
        `<rect class="fault-band" x="${x(f.from)}" y="${24}" width="${w}" height="${height - 48}"/>` +
        `<text class="fault-label" x="${x(f.from) + 2}" y="${24 + 11 + row * 10}">${esc(f.kind)}</text></g>`,
    );
  }
  // Lanes.
  for (const lane of t.lanes) {
    const y = laneY(lane);
    parts.push(
      `<g class="lane" data-process="${esc(lane)}"><rect class="lane-bg" x="${left}" y="${y + 4}" width="${width - left - 20}" height="${laneH - 8}"/>` +
        `<text class="lane-label" x="8" y="${y + laneH / 2 + 5}">${esc(lane)}</text></g>`,
    );
  }
  // Leases.
  for (const h of t.holds) {
    const y = laneY(h.process);
    const w = Math.max(1, (h.to - h.from) * pxPerMs);
    const label = `fence ${fenceLabel(h.fence)}`;
    parts.push(
      `<g class="lease lease-${h.end}" data-fence="${esc(h.fence)}"><title>${esc(`${h.process} held ${h.lock} with fence ${h.fence} for ${Math.round(h.to - h.from)} ms (${h.end})`)}</title>` +
        `<rect x="${x(h.from)}" y="${y + 12}" width="${w}" height="${laneH - 24}" rx="3"/>` +
        (w > label.length * 5.6
          ? `<text class="lease-label" x="${x(h.from) + 3}" y="${y + laneH / 2 + 4}">${esc(label)}</text>`
          : '') +
        '</g>',
    );
  }
  // Overlaps, over the leases: where two workers believed they held the same lock at once.
  for (const o of t.overlaps) {
    for (const h of [o.a, o.b]) {
      parts.push(
        `<rect class="overlap" x="${x(o.from)}" y="${laneY(h.process) + 6}" width="${Math.max(1, (o.to - o.from) * pxPerMs)}" height="${laneH - 12}"><title>${esc(`${o.a.process} (fence ${o.a.fence}) and ${o.b.process} (fence ${o.b.fence}) both believed they held ${o.a.lock}`)}</title></rect>`,
      );
    }
  }
  // Refused writes point at the lease that had taken over.
  for (const w of t.writes) {
    if (w.outcome !== 'stale') continue;
    // The most recent lease of another worker, granted before the refusal, with a higher fence.
    const target = /^\d+$/.test(w.fence)
      ? t.holds
          .filter((h) => h.process !== w.process && h.from <= w.time && BigInt(h.fence) > BigInt(w.fence))
          .sort((a, b) => b.from - a.from)[0]
      : undefined;
    if (target) {
      parts.push(
        `<line class="supersede" x1="${x(w.time)}" y1="${laneY(w.process) + laneH / 2}" x2="${x(Math.max(target.from, Math.min(w.time, target.to)))}" y2="${laneY(target.process) + laneH / 2}"/>`,
      );
    }
  }
  // Writes, drawn last so that they sit on top.
  for (const w of t.writes) {
    const cx = x(w.time);
    const cy = laneY(w.process) + laneH / 2;
    const title = `<title>${esc(`${w.process} write with fence ${w.fence}: ${w.outcome}${w.reason && w.outcome !== 'stale' ? ` (${w.reason})` : ''} at ${((w.time - t.start) / 1000).toFixed(3)} s`)}</title>`;
    if (w.outcome === 'stale') {
      parts.push(
        `<g class="write write-refused" data-fence="${esc(w.fence)}">${title}<path d="M${cx - 7} ${cy - 7} L${cx + 7} ${cy + 7} M${cx + 7} ${cy - 7} L${cx - 7} ${cy + 7}"/><circle cx="${cx}" cy="${cy}" r="9"/></g>`,
      );
    } else {
      parts.push(
        `<g class="write write-${w.outcome}" data-fence="${esc(w.fence)}">${title}<circle cx="${cx}" cy="${cy}" r="${w.outcome === 'applied' ? 3.5 : 4.5}"/></g>`,
      );
    }
  }

  const faultKinds = [...new Set(t.faults.map((f) => f.kind))];
  const counts = (kind: string) => t.faults.filter((f) => f.kind === kind).length;
  const verdictText = ok
    ? `No anomalies found — ${plural(report.staleWrites.rejected, 'stale write')} refused, ${report.staleWrites.accepted} accepted`
    : `${report.anomalies.length} anomalies found`;

  return `<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>palisade chaos report</title>
<style>
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2433; background: #fafbfc; }
header { padding: 16px 24px 8px; }
#verdict { font-size: 22px; font-weight: 700; padding: 10px 14px; border-radius: 6px; display: inline-block; }
#verdict.ok { background: #e3f6e8; color: #12602b; border: 1px solid #8fd19e; }
#verdict.bad { background: #fde8e8; color: #9b1c1c; border: 1px solid #f29b9b; }
.summary { color: #4a5568; margin: 8px 0 0; white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 12px; }
.stats { display: flex; gap: 18px; flex-wrap: wrap; margin: 10px 0; }
.stat b { font-size: 18px; display: block; }
.stat.stale b { color: #d7191c; }
.stat.overlap b { color: #c76a00; }
.legend { display: flex; gap: 16px; flex-wrap: wrap; font-size: 12px; margin: 6px 0; align-items: center; }
.legend svg { vertical-align: middle; }
.scroll { overflow-x: auto; padding: 0 24px 24px; }
svg text { font-family: system-ui, sans-serif; }
.tick { stroke: #e2e8f0; stroke-width: 1; }
.tick-label { font-size: 10px; fill: #718096; text-anchor: middle; }
.lane-bg { fill: #ffffff; stroke: #e2e8f0; }
.lane-label { font-size: 13px; font-weight: 600; fill: #2d3748; }
.lease rect { fill: #4c7bd9; fill-opacity: 0.78; stroke: #2c4f99; stroke-width: 0.6; }
.lease-lost rect { fill: #8a97b3; }
.lease-crashed rect { fill: #8a97b3; stroke-dasharray: 3 2; }
.lease-label { font-size: 10px; fill: #fff; pointer-events: none; }
.overlap { fill: #ff9d1c; fill-opacity: 0.5; stroke: #c76a00; stroke-width: 1; }
.write-applied circle { fill: #1a9850; stroke: #fff; stroke-width: 1; }
.write-refused path { stroke: #d7191c; stroke-width: 3; }
.write-refused circle { fill: none; stroke: #d7191c; stroke-width: 2; }
.write-unknown circle { fill: #fff; stroke: #555; stroke-width: 1.5; }
.write-other circle { fill: #999; }
.write.write-refused:hover circle { stroke-width: 4; }
.supersede { stroke: #d7191c; stroke-width: 1.2; stroke-dasharray: 4 3; }
.fault-band { fill-opacity: 0.16; }
.fault-label { font-size: 11px; font-weight: 600; }
.fault-pause .fault-band { fill: #7b3294; } .fault-pause .fault-label { fill: #7b3294; }
.fault-partition .fault-band { fill: #c51b7d; } .fault-partition .fault-label { fill: #c51b7d; }
.fault-kill .fault-band { fill: #111; } .fault-kill .fault-label { fill: #111; }
.fault-terminate .fault-band { fill: #b35806; } .fault-terminate .fault-label { fill: #b35806; }
.fault-flush .fault-band { fill: #01665e; } .fault-flush .fault-label { fill: #01665e; }
.fault-restart .fault-band { fill: #2166ac; } .fault-restart .fault-label { fill: #2166ac; }
.fault-failover .fault-band, .fault-failback .fault-band, .fault-resync .fault-band, .fault-promote .fault-band { fill: #8c510a; }
.fault-failover .fault-label, .fault-failback .fault-label, .fault-resync .fault-label, .fault-promote .fault-label { fill: #8c510a; }
.fault-other .fault-band { fill: #666; } .fault-other .fault-label { fill: #444; }
ul.anomalies { color: #9b1c1c; }
footer { color: #718096; font-size: 12px; padding: 0 24px 24px; }
</style></head>
<body>
<header>
<div id="verdict" class="${ok ? 'ok' : 'bad'}" data-anomalies="${report.anomalies.length}">${esc(verdictText)}</div>
${fromHistoryOnly ? '<p class="summary">No report.json beside the history: verdict judged from the history alone (no audit table, no counter).</p>' : ''}
${saved ? `<p class="summary">${saved.summary.map(esc).join('\n')}</p>` : ''}
<div class="stats">
<div class="stat stale"><b id="stat-stale">${report.staleWrites.rejected}</b>stale writes refused</div>
<div class="stat"><b>${report.staleWrites.accepted}</b>stale writes accepted</div>
<div class="stat overlap"><b>${report.overlappingHolds}</b>overlapping "I hold it" intervals</div>
<div class="stat"><b>${report.fencesIssued}</b>fences issued</div>
<div class="stat"><b>${report.ops.ok} / ${report.ops.fail} / ${report.ops.unknown}</b>operations ok / failed / unknown</div>
<div class="stat"><b>${t.faults.length}</b>faults: ${faultKinds.map((k) => `${counts(k)} ${esc(k)}`).join(', ') || 'none'}</div>
</div>
${report.anomalies.length > 0 ? `<ul class="anomalies">${report.anomalies.map((a) => `<li>${esc(a)}</li>`).join('')}</ul>` : ''}
<div class="legend">
<span><svg width="34" height="14"><rect x="1" y="2" width="32" height="10" rx="2" fill="#4c7bd9"/></svg> lease (fence labelled)</span>
<span><svg width="34" height="14"><rect x="1" y="2" width="32" height="10" fill="#ff9d1c" fill-opacity="0.5" stroke="#c76a00"/></svg> overlap: two workers believed they held the lock at once</span>
<span><svg width="14" height="14"><circle cx="7" cy="7" r="4" fill="#1a9850"/></svg> write applied</span>
<span><svg width="20" height="20"><path d="M3 3 L17 17 M17 3 L3 17" stroke="#d7191c" stroke-width="3"/><circle cx="10" cy="10" r="9" fill="none" stroke="#d7191c" stroke-width="2"/></svg> write refused as stale (dashed line: the lease that had taken over)</span>
<span><svg width="14" height="14"><circle cx="7" cy="7" r="4" fill="#999"/></svg> refused otherwise (duplicate, missing)</span>
<span><svg width="14" height="14"><circle cx="7" cy="7" r="4" fill="#fff" stroke="#555"/></svg> outcome unknown (crashed)</span>
<span>bands: faults (pause, kill, terminate, flush, restart, …)</span>
</div>
</header>
<div class="scroll">
<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" data-stale-in-history="${staleInHistory}">
${parts.join('\n')}
</svg>
</div>
<footer id="rendered">Rendered from the saved history by <code>npm run chaos:report -- &lt;run directory&gt;</code>.</footer>
<script>
// Counts what the browser actually drew, for readers and for the report's own test.
(function () {
  var svg = document.getElementById('timeline');
  var footer = document.getElementById('rendered');
  footer.setAttribute('data-drawn-refused', String(svg.querySelectorAll('g.write-refused').length));
  footer.setAttribute('data-drawn-lanes', String(svg.querySelectorAll('g.lane').length));
  footer.setAttribute('data-drawn-leases', String(svg.querySelectorAll('g.lease').length));
})();
</script>
</body></html>
`;
}

function naturalOrder(a: string, b: string): number {
  return a.localeCompare(b, 'en', { numeric: true });
}

function plural(n: number, noun: string): string {
  return `${n} ${noun}${n === 1 ? '' : 's'}`;
}
