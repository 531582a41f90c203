/**
 * Section 8 — what the OpenTelemetry instrumentation costs the client, as
 * CPU time per operation (process.cpuUsage over the timed calls; steadier
 * here than throughput on a shared machine):
 *
 * - **without it**: every hook takes the path it takes when
 *   `@opentelemetry/api` is not installed (a null check, then the call);
 * - **api, no SDK**: the package loaded, nothing registered — what every
 *   user who does not configure OpenTelemetry runs (the goal: ≤ 3%);
 * - **SDK registered**: a real `MeterProvider` and `BasicTracerProvider`
 *   recording everything (spans go to no exporter) — for information.
 *
 * For a palisade Redis lock cycle (acquire + release) and a repository
 * write (`update`, serial). The three configurations rotate between rounds.
 */
import { MeterProvider } from '@opentelemetry/sdk-metrics';
import { BasicTracerProvider } from '@opentelemetry/sdk-trace-base';
import { drizzle } from 'drizzle-orm/postgres-js';
import type { Database } from '../../src/driver.js';
import type { Fence } from '../../src/fencing/fence.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { configureTelemetry, setTelemetryLoaded } from '../../src/telemetry/otel.js';
import type { BenchContext } from '../lib/context.js';
import { palisadeRedis } from '../lib/locks.js';
import { type Case, compare } from '../lib/measure.js';
import { ms, ops, pct, printTable } from '../lib/report.js';
import { createAccounts, FenceCounter, makeAccounts, randomId } from '../lib/tables.js';

const ROWS = 10_000;
const GOAL = 0.03;

type Mode = 'without it' | 'api, no SDK' | 'SDK registered';
const MODES: readonly Mode[] = ['without it', 'api, no SDK', 'SDK registered'];

export async function telemetry(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const meterProvider = new MeterProvider();
  const tracerProvider = new BasicTracerProvider();
  const setMode = async (mode: Mode) => {
    setTelemetryLoaded(mode !== 'without it');
    configureTelemetry(mode === 'SDK registered' ? { meterProvider, tracerProvider } : {});
  };

  const lock = palisadeRedis(ctx, 'bench-otel');
  const sql = ctx.pg.client(4);
  const db = drizzle(sql) as unknown as Database;
  await createAccounts(ctx.pg.sql, 'bench_otel', ROWS);
  const repo = fencedRepository(db, makeAccounts('bench_otel'));
  const fences = new FenceCounter(1_000_000_000n);
  try {
    const workloads: { what: string; unit: string; fn: () => Promise<unknown> }[] = [
      {
        what: 'palisade Redis lock cycle (acquire + release)',
        unit: 'cycle',
        fn: async () => (await lock.acquire('otel', 2_000)).release(),
      },
      {
        what: 'repository.update',
        unit: 'write',
        fn: () => repo.update({ id: randomId(ROWS) }, fences.next() as Fence, { balance: 1 }),
      },
    ];
    // More rounds than the other sections: the differences sought are a few percent of CPU.
    const rounds = Math.max(scale.rounds, scale.name === 'full' ? 9 : 3);
    const t = report.table(
      '8. Telemetry overhead (client CPU per operation, serial)',
      'OpenTelemetry off / no SDK / SDK',
      ['operation', 'configuration', 'client CPU µs/op', 'vs without it', 'ops/s', 'p50 ms'],
    );
    for (const w of workloads) {
      const cases: Case[] = MODES.map((mode) => ({ name: mode, before: () => setMode(mode), fn: w.fn }));
      const m = await compare(cases, { concurrency: 1, rounds, timeMs: Math.max(scale.timeMs, 1000) });
      const base = m.find((r) => r.name === 'without it')?.cpuUsPerCall ?? Number.NaN;
      for (const r of m) {
        t.rows.push([
          w.what,
          r.name,
          r.cpuUsPerCall.toFixed(1),
          pct(r.cpuUsPerCall / base - 1),
          ops(r.opsPerSec),
          ms(r.p50Ms),
        ]);
      }
      const noSdk = (m.find((r) => r.name === 'api, no SDK')?.cpuUsPerCall ?? Number.NaN) / base - 1;
      report.goal({
        section: '8',
        goal: `OpenTelemetry without an SDK costs ≤ 3% client CPU per ${w.unit} (${w.what})`,
        measured: `${pct(noSdk)} (${base.toFixed(1)} → ${(base * (1 + noSdk)).toFixed(1)} µs/${w.unit})`,
        met: Number.isFinite(noSdk) ? noSdk <= GOAL : null,
      });
      report.raw[`telemetry ${w.what}`] = m;
    }
    t.notes.push(
      '"without it": every hook takes the path it takes when @opentelemetry/api is not installed. "SDK registered": a MeterProvider without readers and a BasicTracerProvider without span processors — recording, exporting nothing. CPU is this process\'s user + system time over the timed calls, median of the rounds.',
    );
    printTable(t);
  } finally {
    setTelemetryLoaded(true);
    configureTelemetry();
    await meterProvider.shutdown();
    await tracerProvider.shutdown();
    await lock.close();
    await sql.end({ timeout: 5 });
  }
}
