/**
 * Section 8 — what the OpenTelemetry instrumentation costs the client, as
 * CPU time per operation (process.cpuUsage over the timed calls; steadier
 * here than throughput on a shared machine):
 *
 * - **without it**: every hook takes the path it takes when
 *   `@opentelemetry/api` is not installed (a null check, then the call);
 * - **without it, again**: the same, an A/A control — its distance from the
 *   first is the noise of the measurement;
 * - **api, no SDK**: the package loaded, nothing registered — what every
 *   user who does not configure OpenTelemetry runs (the goal: ≤ 3%);
 * - **SDK registered**: a real `MeterProvider` and `BasicTracerProvider`
 *   recording everything (spans go to no exporter) — for information.
 *
 * For a palisade Redis lock cycle (acquire + release) and a repository
 * write (`update`, serial). Each measurement runs in a process of its own
 * (telemetry-child.ts) that never switches configuration; the
 * configurations alternate, in a rotated order, over several rounds, and
 * each is compared with "without it" of the same round.
 */
import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import type { BenchContext } from '../lib/context.js';
import { median } from '../lib/measure.js';
import { COMPILED } from '../lib/paths.js';
import { ops, pct, printTable } from '../lib/report.js';
import { createAccounts } from '../lib/tables.js';
import type { ChildArgs } from './telemetry-child.js';

const run = promisify(execFile);
const CHILD = fileURLToPath(new URL(`./telemetry-child.${COMPILED ? 'js' : 'ts'}`, import.meta.url));
// Compiled, the child runs as it is; from source, through tsx.
const LOADER = COMPILED ? [] : ['--import', 'tsx'];
const ROWS = 10_000;
const GOAL = 0.03;
const MODES: readonly ChildArgs['mode'][] = ['without it', 'without it, again', 'api, no SDK', 'SDK registered'];

export async function telemetry(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const table = 'bench_otel';
  await createAccounts(ctx.pg.sql, table, ROWS);
  const full = scale.name === 'full';
  let fenceBase = 1_000_000_000n;
  const t = report.table(
    '8. Telemetry overhead (client CPU per operation, serial)',
    'OpenTelemetry off / no SDK / SDK',
    ['operation', 'configuration', 'client CPU µs/op (median)', 'vs without it (median of rounds)', 'calls', 'ops/s'],
  );
  const workloads = [
    { workload: 'cycle' as const, what: 'palisade Redis lock cycle (acquire + release)' },
    { workload: 'write' as const, what: 'repository.update' },
    { workload: 'hooks-cycle' as const, what: 'the acquire and release hooks alone (no I/O)' },
    { workload: 'hooks-write' as const, what: 'the write hook alone (no I/O)' },
  ];
  const cpuWithout: Record<string, number> = {};
  const plan: string[] = [];
  for (const w of workloads) {
    // Each process draws its own luck (JIT, heap layout): the end-to-end cases, whose goal sits
    // within a few % of that noise, get 7 rounds; the hooks alone, without I/O, vary far less.
    const hooks = w.workload.startsWith('hooks');
    const rounds = full ? (hooks ? 5 : 7) : 2;
    const ms = full ? (hooks ? 1_000 : 2_000) : 1_000;
    plan.push(`${w.what}: ${rounds} rounds of ${ms / 1000} s`);
    const per = Object.fromEntries(
      MODES.map((m) => [m, { cpu: [] as number[], ratio: [] as number[], calls: 0, wall: 0 }]),
    );
    for (let round = 0; round < rounds; round++) {
      const inRound: Record<string, number> = {};
      for (let k = 0; k < MODES.length; k++) {
        const mode = MODES[(k + round) % MODES.length] as ChildArgs['mode'];
        const args: ChildArgs = {
          mode,
          workload: w.workload,
          ms,
          redisUrl: ctx.redis.url,
          namespace: `${ctx.redis.prefix}bench-otel`.replaceAll(':', '.'),
          databaseUrl: ctx.pg.url,
          table,
          rows: ROWS,
          fenceBase: fenceBase.toString(),
        };
        fenceBase += 100_000_000n;
        const { stdout } = await run(process.execPath, [...LOADER, CHILD, JSON.stringify(args)], {
          timeout: ms + 120_000,
        });
        const r = JSON.parse(stdout.trim().split('\n').at(-1) as string) as {
          cpuUs: number;
          calls: number;
          wallMs: number;
        };
        const acc = per[mode] as (typeof per)[string];
        acc.cpu.push(r.cpuUs);
        acc.calls += r.calls;
        acc.wall += r.wallMs;
        inRound[mode] = r.cpuUs;
      }
      for (const mode of MODES) per[mode]?.ratio.push((inRound[mode] as number) / (inRound['without it'] as number));
    }
    for (const mode of MODES) {
      const acc = per[mode] as (typeof per)[string];
      t.rows.push([
        w.what,
        mode,
        median(acc.cpu).toFixed(1),
        pct(median(acc.ratio) - 1),
        acc.calls.toLocaleString('en-US'),
        ops((acc.calls * 1000) / acc.wall),
      ]);
    }
    cpuWithout[w.workload] = median(per['without it']?.cpu ?? []);
    if (w.workload.startsWith('hooks')) {
      // The instrumentation's own cost, as a share of the real operation's CPU without it.
      const real = cpuWithout[w.workload.slice('hooks-'.length)] ?? Number.NaN;
      const added = median(per['api, no SDK']?.cpu ?? []) - (cpuWithout[w.workload] as number);
      const unit = w.workload === 'hooks-cycle' ? 'cycle' : 'write';
      report.goal({
        section: '8',
        goal: `the instrumentation without an SDK adds ≤ 3% client CPU per ${unit} (its hooks timed alone, over the real ${unit}'s CPU)`,
        measured: `${pct(added / real)} (+${added.toFixed(2)} µs over ${real.toFixed(1)} µs)`,
        met: Number.isFinite(added / real) ? added / real <= GOAL : null,
      });
      report.raw[`telemetry ${w.what}`] = per;
      continue;
    }
    const noSdk = median(per['api, no SDK']?.ratio ?? []) - 1;
    const control = median(per['without it, again']?.ratio ?? []) - 1;
    report.goal({
      section: '8',
      goal: `OpenTelemetry without an SDK costs ≤ 3% client CPU per ${w.workload} (${w.what}, end to end)`,
      measured: `${pct(noSdk)} (${median(per['without it']?.cpu ?? []).toFixed(1)} → ${median(per['api, no SDK']?.cpu ?? []).toFixed(1)} µs; A/A control ${pct(control)})`,
      // When the A/A control alone is off by more than the goal, this measurement cannot tell.
      met: Number.isFinite(noSdk) && Math.abs(control) <= GOAL ? noSdk <= GOAL : null,
      ...(Math.abs(control) > GOAL
        ? { why: `the A/A control differs by ${pct(control)}: the noise here exceeds the 3% sought` }
        : {}),
    });
    report.raw[`telemetry ${w.what}`] = per;
  }
  t.notes.push(
    `Each configuration in a process of its own (warmed up, then timed: ${plan.join('; ')}), the configurations in a rotated order each round; CPU is the child's user + system time over the timed calls. "without it": every hook takes the path it takes when @opentelemetry/api is not installed; "without it, again" is an A/A control. "SDK registered": a MeterProvider without readers and a BasicTracerProvider without span processors — recording, exporting nothing.`,
  );
  printTable(t);
}
