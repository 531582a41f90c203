/**
 * Section 8 — what the OpenTelemetry instrumentation costs the client, as
 * CPU time per operation (process.cpuUsage around each call; steadier here
 * than throughput on a shared machine):
 *
 * - **without it**: every hook takes the path it takes when
 *   `@opentelemetry/api` is not installed (a null check, then the call);
 * - **api, no SDK**: the package loaded, nothing registered — what every
 *   user who does not configure OpenTelemetry runs (the goal: ≤ 3%);
 * - **SDK registered**: a real `MeterProvider` and `BasicTracerProvider`
 *   recording everything (spans go to no exporter) — for information.
 *
 * For a palisade Redis lock cycle (acquire + release) and a repository
 * write (`update`, serial). The configurations are interleaved in blocks of
 * 100 calls (rotating their order), so load from the rest of the machine
 * falls on all of them alike; the ratio is the median over the blocks.
 */
import { performance } from 'node:perf_hooks';
import { MeterProvider } from '@opentelemetry/sdk-metrics';
import { BasicTracerProvider } from '@opentelemetry/sdk-trace-base';
import { drizzle } from 'drizzle-orm/postgres-js';
import type { Database } from '../../src/driver.js';
import type { Fence } from '../../src/fencing/fence.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { configureTelemetry, setTelemetryLoaded } from '../../src/telemetry/otel.js';
import type { BenchContext } from '../lib/context.js';
import { palisadeRedis } from '../lib/locks.js';
import { median } from '../lib/measure.js';
import { ops, pct, printTable } from '../lib/report.js';
import { createAccounts, FenceCounter, makeAccounts, randomId } from '../lib/tables.js';

const ROWS = 10_000;
const GOAL = 0.03;
const BLOCK = 100;

// "without it, again" is an A/A control: its distance from "without it" is the noise of the measurement.
type Mode = 'without it' | 'without it, again' | 'api, no SDK' | 'SDK registered';
const MODES: readonly Mode[] = ['without it', 'without it, again', 'api, no SDK', 'SDK registered'];

interface Paired {
  /** CPU µs per call, over all calls. */
  readonly cpuUs: Record<Mode, number>;
  /** Per block of BLOCK calls: CPU of each mode over the same block of "without it". */
  readonly blockRatios: Record<Mode, number[]>;
  readonly calls: Record<Mode, number>;
  readonly wallMs: Record<Mode, number>;
}

/** Interleaves the modes in blocks until `durationMs` has passed (at least 3 blocks each). */
async function paired(setMode: (mode: Mode) => void, fn: () => Promise<unknown>, durationMs: number): Promise<Paired> {
  const zero = () => Object.fromEntries(MODES.map((m) => [m, 0])) as Record<Mode, number>;
  const cpu = zero();
  const calls = zero();
  const wall = zero();
  const blockRatios = Object.fromEntries(MODES.map((m) => [m, [] as number[]])) as Record<Mode, number[]>;
  // Warm-up in every mode: connections, prepared statements, the JIT, the instruments.
  for (const mode of MODES) {
    setMode(mode);
    for (let i = 0; i < 200; i++) await fn();
  }
  const deadline = performance.now() + durationMs;
  for (let block = 0; block < 3 || performance.now() < deadline; block++) {
    const inBlock = {} as Record<Mode, number>;
    for (let k = 0; k < MODES.length; k++) {
      const mode = MODES[(k + block) % MODES.length] as Mode;
      setMode(mode);
      await fn(); // the first call after a switch may rebuild the instruments: not counted
      let used = 0;
      const t0 = performance.now();
      for (let i = 0; i < BLOCK; i++) {
        const c0 = process.cpuUsage();
        await fn();
        const c = process.cpuUsage(c0);
        used += c.user + c.system;
      }
      wall[mode] += performance.now() - t0;
      cpu[mode] += used;
      calls[mode] += BLOCK;
      inBlock[mode] = used;
    }
    for (const mode of MODES) blockRatios[mode].push(inBlock[mode] / inBlock['without it']);
  }
  const cpuUs = {} as Record<Mode, number>;
  for (const mode of MODES) cpuUs[mode] = cpu[mode] / calls[mode];
  return { cpuUs, blockRatios, calls, wallMs: wall };
}

export async function telemetry(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const meterProvider = new MeterProvider();
  const tracerProvider = new BasicTracerProvider();
  const setMode = (mode: Mode) => {
    setTelemetryLoaded(mode === 'api, no SDK' || mode === 'SDK registered');
    configureTelemetry(mode === 'SDK registered' ? { meterProvider, tracerProvider } : {});
  };

  const lock = palisadeRedis(ctx, 'bench-otel');
  // As in section 1: the WAL flush is the same for every configuration and would swamp the difference.
  const sql = ctx.pg.client(4, { synchronous_commit: 'off' });
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
    const durationMs = scale.name === 'full' ? 30_000 : 3_000;
    const t = report.table(
      '8. Telemetry overhead (client CPU per operation, serial)',
      'OpenTelemetry off / no SDK / SDK',
      [
        'operation',
        'configuration',
        'client CPU µs/op',
        'vs without it (median of blocks)',
        'vs without it (all calls)',
        'calls',
        'ops/s',
      ],
    );
    for (const w of workloads) {
      const m = await paired(setMode, w.fn, durationMs);
      const base = m.cpuUs['without it'];
      for (const mode of MODES) {
        t.rows.push([
          w.what,
          mode,
          m.cpuUs[mode].toFixed(1),
          pct(median(m.blockRatios[mode]) - 1),
          pct(m.cpuUs[mode] / base - 1),
          m.calls[mode].toLocaleString('en-US'),
          ops((m.calls[mode] * 1000) / m.wallMs[mode]),
        ]);
      }
      const noSdk = median(m.blockRatios['api, no SDK']) - 1;
      const control = median(m.blockRatios['without it, again']) - 1;
      report.goal({
        section: '8',
        goal: `OpenTelemetry without an SDK costs ≤ 3% client CPU per ${w.unit} (${w.what})`,
        measured: `${pct(noSdk)} (${base.toFixed(1)} → ${m.cpuUs['api, no SDK'].toFixed(1)} µs/${w.unit}; A/A control ${pct(control)})`,
        met: Number.isFinite(noSdk) ? noSdk <= GOAL : null,
      });
      report.raw[`telemetry ${w.what}`] = m;
    }
    t.notes.push(
      `Configurations interleaved in blocks of ${BLOCK} calls, order rotated per block, ${durationMs / 1000} s per operation; CPU is this process's user + system time around each call. "without it": every hook takes the path it takes when @opentelemetry/api is not installed. "SDK registered": a MeterProvider without readers and a BasicTracerProvider without span processors — recording, exporting nothing.`,
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
