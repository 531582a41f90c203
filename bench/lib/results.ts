/**
 * The results file: run metadata (date, versions, machine, load) and the
 * markdown the README quotes.
 */
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { cpus, loadavg } from 'node:os';
import { join } from 'node:path';
import type { BenchContext } from './context.js';
import { FINDINGS, PEERS } from './findings.js';
import { ROOT } from './paths.js';
import { markdownTable, type Report } from './report.js';

export interface RunMeta {
  readonly date: string;
  readonly finished: string;
  readonly scale: string;
  readonly sections: string;
  readonly node: string;
  readonly postgres: string;
  readonly redis: string;
  readonly redisServer: string;
  readonly machine: string;
  readonly loadAverage: string;
  readonly packages: Record<string, string>;
  readonly syncguard: string;
}

const PACKAGES = ['drizzle-orm', 'postgres', 'ioredis', 'redis-semaphore', '@sesamecare-oss/redlock'] as const;

const require = createRequire(import.meta.url);

function packageVersion(name: string): string {
  try {
    const path = require.resolve(`${name}/package.json`);
    return (JSON.parse(readFileSync(path, 'utf8')) as { version: string }).version;
  } catch {
    // Packages whose `exports` hide package.json: find it beside the entry point.
    try {
      let dir = require.resolve(name);
      for (let i = 0; i < 5; i++) {
        dir = dir.slice(0, dir.lastIndexOf('/'));
        try {
          const pkg = JSON.parse(readFileSync(`${dir}/package.json`, 'utf8')) as { name?: string; version: string };
          if (pkg.name === name) return pkg.version;
        } catch {
          // keep climbing
        }
      }
    } catch {
      // not installed
    }
    return 'not installed';
  }
}

export async function runMeta(
  ctx: BenchContext,
  started: Date,
  finished: Date,
  only: readonly string[] | undefined,
): Promise<RunMeta> {
  const [row] = await ctx.pg.sql`select current_setting('server_version') as v`;
  const own = JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8')) as { version: string };
  const packages: Record<string, string> = { palisade: own.version };
  for (const p of PACKAGES) packages[p] = packageVersion(p);
  const cpu = cpus();
  return {
    date: started.toISOString(),
    finished: finished.toISOString(),
    scale: ctx.scale.name,
    sections: only ? only.join(',') : 'all',
    node: process.version,
    postgres: String(row?.v ?? 'unknown'),
    redis: ctx.redis.version,
    redisServer: ctx.redis.own
      ? 'own redis-server on a loopback port (exact commandstats)'
      : 'shared server, key prefix',
    machine: `${cpu.length} × ${cpu[0]?.model.trim() ?? 'cpu'}, ${process.platform}/${process.arch}`,
    loadAverage: `${loadavg()
      .map((x) => x.toFixed(2))
      .join(' ')} (1/5/15 min, at the end)`,
    packages,
    syncguard: ctx.syncguardPath
      ? 'not in the npm registry reachable here (404); a local build of its public source, loaded from SYNCGUARD_PATH (see Peers)'
      : 'skipped: not in the npm registry reachable here (404) and SYNCGUARD_PATH unset (see Peers)',
  };
}

export function renderMarkdown(meta: RunMeta, report: Report): string {
  const lines: string[] = [];
  lines.push('# palisade benchmarks — latest run', '');
  lines.push(
    `Run ${meta.date.slice(0, 16).replace('T', ' ')} UTC (${meta.scale} scale, sections: ${meta.sections}) · ` +
      `Node ${meta.node} · PostgreSQL ${meta.postgres} · Redis ${meta.redis} · ${meta.machine}`,
    '',
  );
  lines.push(
    'Packages: ' +
      Object.entries(meta.packages)
        .map(([k, v]) => `${k} ${v}`)
        .join(', ') +
      `; syncguard: ${meta.syncguard}.`,
    '',
  );
  lines.push(`Load average: ${meta.loadAverage}. Redis: ${meta.redisServer}.`, '');
  lines.push(
    'All numbers come from this one run; compare the ratios, not the absolute numbers (a shared 2-core machine).',
    'Each comparison: short blocks (60 ms at full scale) of every case, rotated, over many rounds, the young generation collected between rounds; a ratio is the median of the per-round ratios, with their min–max, and an A/A control row shows the noise floor where a table has one. p50/p99 are per call; per-round numbers are in latest.json. The library runs compiled by tsc, as published. Regenerate with `npm run bench`.',
    '',
  );
  if (report.goals.length > 0) {
    lines.push('## Goals', '');
    lines.push('| section | goal | measured | verdict |', '| --- | --- | --- | --- |');
    for (const g of report.goals) {
      const verdict = g.met === null ? 'not measured' : g.met ? 'met' : 'missed';
      lines.push(`| ${g.section} | ${g.goal} | ${g.measured} | ${verdict}${g.why ? ` — ${g.why}` : ''} |`);
    }
    lines.push('');
  }
  let section = '';
  for (const t of report.tables) {
    if (t.section !== section) {
      section = t.section;
      lines.push(`## ${section}`, '');
    }
    lines.push(`### ${t.title}`, '', markdownTable(t), '');
    for (const n of t.notes) lines.push(`- ${n}`);
    if (t.notes.length > 0) lines.push('');
  }
  lines.push('## Why goals are missed, and what was fixed', '');
  for (const f of FINDINGS) lines.push(`- ${f}`);
  lines.push('', '## Peers', '');
  for (const p of PEERS) lines.push(`- ${p}`);
  lines.push('');
  if (report.notes.length > 0) {
    lines.push('## Notes', '');
    for (const n of report.notes) lines.push(`- ${n}`);
    lines.push('');
  }
  return `${lines.join('\n')}\n`;
}
