/**
 * What a run records: tables (one or more per section), goals with their
 * verdicts, and notes. Written as `bench/results/latest.json` (everything,
 * including per-round numbers) and `bench/results/latest.md` (what the
 * README quotes).
 */
import { type Measured, pairedRatio } from './measure.js';

export type Cell = string | number | null;

export interface Table {
  readonly section: string;
  readonly title: string;
  readonly columns: readonly string[];
  readonly rows: Cell[][];
  readonly notes: string[];
}

export interface Goal {
  readonly section: string;
  readonly goal: string;
  readonly measured: string;
  /** `null` when it could not be measured in this run. */
  readonly met: boolean | null;
  readonly why?: string;
}

export class Report {
  readonly tables: Table[] = [];
  readonly goals: Goal[] = [];
  readonly notes: string[] = [];
  readonly raw: Record<string, unknown> = {};

  table(section: string, title: string, columns: readonly string[]): Table {
    const t: Table = { section, title, columns, rows: [], notes: [] };
    this.tables.push(t);
    return t;
  }

  goal(g: Goal): void {
    this.goals.push(g);
    const mark = g.met === null ? 'n/a' : g.met ? 'MET' : 'MISSED';
    console.log(`  goal [${mark}] ${g.goal}: ${g.measured}${g.why ? ` — ${g.why}` : ''}`);
  }

  note(text: string): void {
    this.notes.push(text);
    console.log(`  note: ${text}`);
  }
}

/** Formats ops/s with thousands separators. */
export const ops = (x: number): string => (Number.isFinite(x) ? Math.round(x).toLocaleString('en-US') : 'n/a');
/** Formats milliseconds with 2 decimals (3 below 1 ms). */
export const ms = (x: number): string => (Number.isFinite(x) ? x.toFixed(x < 1 ? 3 : 2) : 'n/a');
/** Formats a ratio as `0.97×`. */
export const ratio = (x: number): string => (Number.isFinite(x) ? `${x.toFixed(2)}×` : 'n/a');
/** Formats a fraction as a percentage. */
/**
 * The first cells of a comparison table's row: name, ops/s, p50, p99, then
 * `r` over `reference` as the median of their paired per-round ratios and
 * its min–max over the rounds.
 */
export function comparedCells(r: Measured, reference: Measured): string[] {
  const vs = pairedRatio(r, reference);
  return [r.name, ops(r.opsPerSec), ms(r.p50Ms), ms(r.p99Ms), ratio(vs.median), `${ratio(vs.min)}–${ratio(vs.max)}`];
}

export const pct = (x: number, digits = 1): string => (Number.isFinite(x) ? `${(x * 100).toFixed(digits)}%` : 'n/a');

/** Renders one table as GitHub markdown. */
export function markdownTable(t: Table): string {
  const esc = (c: Cell) => (c === null ? '—' : String(c).replaceAll('|', '\\|'));
  const lines = [
    `| ${t.columns.join(' | ')} |`,
    `| ${t.columns.map((_, i) => (i === 0 ? '---' : '---:')).join(' | ')} |`,
    ...t.rows.map((r) => `| ${r.map(esc).join(' | ')} |`),
  ];
  return lines.join('\n');
}

/** Prints a table to the console while the run goes on. */
export function printTable(t: Table): void {
  console.log(`\n${t.section} — ${t.title}`);
  console.log(markdownTable(t));
  for (const n of t.notes) console.log(`  · ${n}`);
}
