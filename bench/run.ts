/**
 * `npm run bench` — palisade side by side with the peers, in ONE run on one
 * machine, reported as ratios. Not part of `npm test`.
 *
 *   npm run bench                      full run, writes bench/results/latest.{md,json}
 *   npm run bench -- --quick           short run for developing the benchmark (writes bench/results/quick.*)
 *   npm run bench -- --only=1,2        some sections only (never written as latest)
 *   npm run bench -- --only=7d         a part of a section that can run alone (here: the tombstone purge)
 *   npm run bench -- --only=2,3 --redis-locks   lock sections with the Redis locks only (no Postgres managers)
 *   npm run bench -- --rounds=5        at least 5 interleaved rounds in every comparison (the handoff too)
 *   npm run bench -- --render          rewrite latest.md and latest.svg from latest.json (after editing the findings)
 *
 * It runs compiled by tsc (bench/build.mjs says why); `node --import tsx
 * bench/run.ts` runs it from source, for developing the benchmark itself.
 *
 * Environment: DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test;
 * a database of the run's own is created and dropped), a `redis-server`
 * binary (a server of the run's own is started on a free loopback port;
 * without one, REDIS_URL with a key prefix), SYNCGUARD_PATH (optional: a
 * local build of syncguard's public source, loaded from there).
 */
import { spawnSync } from 'node:child_process';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { migrate } from '../src/migrate.js';
import { renderRatioChart } from './lib/chart.js';
import { type BenchContext, SCALES } from './lib/context.js';
import { RESULTS, ROOT } from './lib/paths.js';
import { Report } from './lib/report.js';
import { type RunMeta, renderMarkdown, runMeta } from './lib/results.js';
import { benchDatabase, benchRedis, settleDatabase } from './lib/services.js';
import { endToEnd } from './sections/end-to-end.js';
import { fenceIssuance } from './sections/fence-issuance.js';
import { fenceTrigger } from './sections/fence-trigger.js';
import { growth, liveLocks, tombstonePurge } from './sections/growth.js';
import { handoff } from './sections/handoff.js';
import { lockRoundTrips } from './sections/lock-round-trips.js';
import { lockScope } from './sections/lock-scope.js';
import { memory } from './sections/memory.js';
import { telemetry } from './sections/telemetry.js';
import { writePath } from './sections/write-path.js';

// `part`: runs only when named in --only (its section runs it otherwise).
const SECTIONS: { id: string; title: string; run: (ctx: BenchContext) => Promise<void>; part?: true }[] = [
  { id: '1', title: 'Fenced write path', run: writePath },
  { id: '2', title: 'Lock round trips', run: lockRoundTrips },
  { id: '3', title: 'Handoff under contention', run: handoff },
  { id: '4', title: 'End to end', run: endToEnd },
  { id: '5', title: 'Fence issuance', run: fenceIssuance },
  { id: '6', title: 'Memory', run: memory },
  { id: '7', title: 'Growth', run: growth },
  { id: '7b', title: 'Growth: live lock names', run: liveLocks, part: true },
  { id: '7d', title: 'Growth: tombstone purge', run: tombstonePurge, part: true },
  { id: '8', title: 'Telemetry overhead', run: telemetry },
  { id: '9', title: 'Lock scope', run: lockScope },
  { id: '10', title: 'Fence trigger', run: fenceTrigger },
];

/** `--render`: rewrites latest.md from latest.json (e.g. after editing the findings), measuring nothing. */
function renderOnly(): void {
  const out = RESULTS;
  const saved = JSON.parse(readFileSync(join(out, 'latest.json'), 'utf8')) as {
    meta: RunMeta;
    tables: Report['tables'];
    goals: Report['goals'];
    notes: string[];
  };
  const report = new Report();
  report.tables.push(...saved.tables);
  report.goals.push(...saved.goals);
  report.notes.push(...saved.notes);
  writeFileSync(join(out, 'latest.md'), renderMarkdown(saved.meta, report));
  formatResults(join(out, 'latest.md'));
  writeFileSync(join(out, 'latest.svg'), renderRatioChart(saved.tables, chartSubtitle(saved.meta)));
  console.log('rewrote bench/results/latest.md and latest.svg from latest.json');
}

/** Both result files are linted with the rest of bench/: let the project's formatter lay them out. */
function formatResults(...files: string[]): void {
  const biome = join(ROOT, 'node_modules', '.bin', 'biome');
  spawnSync(biome, ['format', '--write', ...files], { stdio: 'ignore', timeout: 60_000 });
}

async function main(): Promise<void> {
  const args = process.argv.slice(2);
  if (args.includes('--render')) return renderOnly();
  const chosen = SCALES[args.includes('--quick') ? 'quick' : 'full'];
  const rounds = Number(args.find((a) => a.startsWith('--rounds='))?.slice('--rounds='.length) ?? 0);
  const scale =
    Number.isInteger(rounds) && rounds > 0
      ? { ...chosen, rounds: Math.max(chosen.rounds, rounds), handoffRounds: Math.max(chosen.handoffRounds, rounds) }
      : chosen;
  const only = args
    .find((a) => a.startsWith('--only='))
    ?.slice('--only='.length)
    .split(',');
  const started = new Date();
  const pg = await benchDatabase(24);
  const redis = await benchRedis();
  const report = new Report();
  const ctx: BenchContext = {
    scale,
    pg,
    redis,
    report,
    syncguardPath: process.env.SYNCGUARD_PATH || undefined,
    redisLocksOnly: args.includes('--redis-locks'),
  };
  let interrupted = false;
  const onSignal = () => {
    interrupted = true;
    console.error('interrupted: cleaning up');
    void Promise.allSettled([pg.close(), redis.close()]).then(() => process.exit(130));
  };
  process.once('SIGINT', onSignal);
  process.once('SIGTERM', onSignal);
  try {
    await migrate(pg.db);
    console.log(
      `palisade bench (${scale.name}) — database ${pg.name}, redis ${redis.url}${redis.own ? ' (own server)' : ''}`,
    );
    const settled: string[] = [];
    for (const section of SECTIONS) {
      if (only ? !only.includes(section.id) : section.part) continue;
      if (interrupted) break;
      const calm = await settleDatabase(pg);
      settled.push(
        `${section.id}: ${calm.seconds.toFixed(1)} s${calm.waitCut ? ' (autovacuum still running at the bound)' : ''}`,
      );
      const t0 = Date.now();
      console.log(`\n=== ${section.id}. ${section.title}`);
      await section.run(ctx);
      await pg.endClients();
      console.log(`  (${((Date.now() - t0) / 1000).toFixed(1)} s)`);
    }
    report.note(
      `Before each section the database settled (no autovacuum worker on it, at most 60 s; then VACUUM (ANALYZE) and CHECKPOINT), so no section starts beside an autovacuum or a checkpoint the one before set off. Time it took, per section: ${settled.join(', ')}.`,
    );
    const meta = await runMeta(ctx, started, new Date(), only);
    const out = RESULTS;
    mkdirSync(out, { recursive: true });
    const base = only ? 'partial' : scale.name === 'full' ? 'latest' : 'quick';
    writeFileSync(
      join(out, `${base}.json`),
      `${JSON.stringify({ meta, tables: report.tables, goals: report.goals, notes: report.notes, raw: report.raw }, bigintJson, 2)}\n`,
    );
    writeFileSync(join(out, `${base}.md`), renderMarkdown(meta, report));
    formatResults(join(out, `${base}.json`), join(out, `${base}.md`));
    writeFileSync(join(out, `${base}.svg`), renderRatioChart(report.tables, chartSubtitle(meta)));
    console.log(`\nwrote bench/results/${base}.md, ${base}.json and ${base}.svg`);
  } finally {
    process.off('SIGINT', onSignal);
    process.off('SIGTERM', onSignal);
    await Promise.allSettled([pg.close(), redis.close()]);
  }
}

/** The chart's second line: when, where, at which scale. */
function chartSubtitle(meta: RunMeta): string {
  return `${meta.date.slice(0, 16).replace('T', ' ')} UTC · ${meta.scale} scale, sections: ${meta.sections} · Node ${meta.node} · PostgreSQL ${meta.postgres.split(' ')[0]} · Redis ${meta.redis} · ${meta.machine}`;
}

function bigintJson(_key: string, value: unknown): unknown {
  return typeof value === 'bigint' ? value.toString() : value;
}

main().catch((err) => {
  console.error(err);
  process.exitCode = 1;
});
