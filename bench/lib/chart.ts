/**
 * The benchmark's ratios as one SVG bar chart (`bench/results/latest.svg`,
 * shown in the README): one bar group per measurement (a results table with
 * a `×` column), palisade and the peers side by side in it, and the goal of
 * that measurement drawn as a line. Hand-written SVG: no dependency, and it
 * renders the same on GitHub and from disk.
 */
import type { Cell, Table } from './report.js';

/** Goals drawn per section (the ratio the section's goal names); other groups get a 1× reference line. */
const GOALS: Record<string, { value: number; label: string }> = {
  '1': { value: 0.95, label: 'goal ≥ 0.95×' },
  '2': { value: 1, label: 'goal ≥ 1.0×' },
  '3': { value: 1, label: 'goal ≥ 1.0×' },
};

interface Bar {
  readonly label: string;
  readonly value: number;
  readonly palisade: boolean;
}

interface Group {
  readonly title: string;
  readonly bars: readonly Bar[];
  readonly goal: { value: number; label: string } | undefined;
}

/** Parses `0.79×` (or `1,234`) to a number; NaN if it is not one. */
function ratioOf(cell: Cell | undefined): number {
  if (typeof cell === 'number') return cell;
  if (typeof cell !== 'string') return Number.NaN;
  const m = /^(-?\d+(?:\.\d+)?)×$/.exec(cell.trim());
  return m ? Number(m[1]) : Number.NaN;
}

/** The groups: every table whose columns include one that starts with `×`. */
export function chartGroups(tables: readonly Table[]): Group[] {
  const groups: Group[] = [];
  for (const t of tables) {
    const col = t.columns.findIndex((c) => c.startsWith('×'));
    if (col < 0) continue;
    const bars = t.rows
      .map((r) => ({ label: String(r[0]), value: ratioOf(r[col]), palisade: String(r[0]).startsWith('palisade') }))
      .filter((b) => Number.isFinite(b.value));
    if (bars.length === 0) continue;
    const section = /^(\d+)/.exec(t.section)?.[1] ?? '';
    groups.push({
      title: `${t.section.replace(/\s*\(.*\)$/, '')} — ${t.title} (${t.columns[col]})`,
      bars,
      goal: GOALS[section],
    });
  }
  return groups;
}

const esc = (s: string) => s.replaceAll('&', '&amp;').replaceAll('<', '&lt;').replaceAll('>', '&gt;');

/** Renders the chart. `subtitle`: the run's date and machine. */
export function renderRatioChart(tables: readonly Table[], subtitle: string): string {
  const groups = chartGroups(tables);
  const barW = 18;
  const gap = 4;
  const groupGap = 34;
  const left = 54;
  const top = 100;
  const plotH = 260;
  const labelH = 230;
  const maxValue = Math.max(1.2, ...groups.flatMap((g) => g.bars.map((b) => b.value)));
  const y = (v: number) => top + plotH - (Math.min(v, maxValue) / maxValue) * plotH;

  const parts: string[] = [];
  let x = left + 10;
  for (const g of groups) {
    const w = g.bars.length * (barW + gap) - gap;
    const titleLines = wrap(g.title, Math.max(18, Math.floor((w + groupGap - 6) / 5.6)));
    parts.push(
      `<g class="group"><rect x="${x - 6}" y="${top - 4}" width="${w + 12}" height="${plotH + 4}" fill="#f6f8fa"/>`,
      ...titleLines
        .slice(0, 3)
        .map(
          (line, i) => `<text x="${x - 4}" y="${top - 48 + i * 11}" font-size="9.5" fill="#444">${esc(line)}</text>`,
        ),
    );
    g.bars.forEach((b, i) => {
      const bx = x + i * (barW + gap);
      const by = y(b.value);
      const fill = b.palisade ? '#2f6fde' : '#9aa4b2';
      parts.push(
        `<rect x="${bx}" y="${by}" width="${barW}" height="${top + plotH - by}" fill="${fill}"><title>${esc(`${b.label}: ${b.value.toFixed(2)}×`)}</title></rect>`,
        `<text x="${bx + barW / 2}" y="${by - 3}" font-size="8.5" text-anchor="middle" fill="#222">${b.value.toFixed(2)}</text>`,
        `<text transform="translate(${bx + barW / 2 + 3},${top + plotH + 6}) rotate(60)" font-size="9" fill="${b.palisade ? '#1d4fa8' : '#444'}">${esc(truncate(b.label, 40))}</text>`,
      );
    });
    const goal = g.goal ?? { value: 1, label: '1×' };
    const gy = y(goal.value);
    parts.push(
      `<line x1="${x - 6}" x2="${x + w + 6}" y1="${gy}" y2="${gy}" stroke="${g.goal ? '#d7191c' : '#666'}" stroke-width="${g.goal ? 2 : 1}" stroke-dasharray="${g.goal ? '6 3' : '2 3'}"/>`,
      g.goal
        ? `<text x="${x - 4}" y="${top - 8}" font-size="9" font-weight="600" fill="#d7191c">${esc(goal.label)}</text>`
        : '',
      '</g>',
    );
    x += w + groupGap;
  }
  const width = Math.ceil(x + 70); // room for the last group's slanted labels
  const height = top + plotH + labelH;
  // The y axis: ratio ticks.
  const axis: string[] = [];
  for (let v = 0; v <= maxValue + 1e-9; v += 0.25) {
    axis.push(
      `<line x1="${left}" x2="${width - 10}" y1="${y(v)}" y2="${y(v)}" stroke="#e1e4e8" stroke-width="1"/>`,
      `<text x="${left - 6}" y="${y(v) + 3}" font-size="9" text-anchor="end" fill="#666">${v.toFixed(2)}×</text>`,
    );
  }
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" font-family="system-ui, -apple-system, Segoe UI, sans-serif" role="img" aria-labelledby="bench-chart-title">
<title id="bench-chart-title">palisade bench: ratios against the peers and baselines, with the goals</title>
<rect width="100%" height="100%" fill="#ffffff"/>
<text x="${left}" y="16" font-size="13" font-weight="700" fill="#111">palisade bench — ratios (higher is better), one group per measurement</text>
<text x="${left}" y="30" font-size="10" fill="#555">${esc(subtitle)}</text>
<rect x="${width - 330}" y="8" width="10" height="10" fill="#2f6fde"/><text x="${width - 316}" y="17" font-size="10">palisade</text>
<rect x="${width - 260}" y="8" width="10" height="10" fill="#9aa4b2"/><text x="${width - 246}" y="17" font-size="10">peer or baseline</text>
<line x1="${width - 160}" x2="${width - 136}" y1="13" y2="13" stroke="#d7191c" stroke-width="2" stroke-dasharray="6 3"/><text x="${width - 132}" y="17" font-size="10">goal</text>
<line x1="${width - 100}" x2="${width - 76}" y1="13" y2="13" stroke="#666" stroke-dasharray="2 3"/><text x="${width - 72}" y="17" font-size="10">1× reference</text>
${axis.join('\n')}
${parts.join('\n')}
</svg>
`;
}

function truncate(s: string, n: number): string {
  return s.length <= n ? s : `${s.slice(0, n - 1)}…`;
}

function wrap(s: string, n: number): string[] {
  const lines: string[] = [];
  let line = '';
  for (const word of s.split(' ')) {
    if (line && line.length + 1 + word.length > n) {
      lines.push(line);
      line = word;
    } else line = line ? `${line} ${word}` : word;
  }
  if (line) lines.push(line);
  return lines;
}
