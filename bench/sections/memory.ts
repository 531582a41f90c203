/**
 * Section 6 — memory and handles over many acquire/release cycles with the
 * watchdog on (`autoExtend: true`): heap after a forced GC and the count of
 * active handles/requests, at the start (after a warm-up) and at the end.
 * 16 clients on 16 names, so that 100,000 cycles fit in the run's time.
 * Needs `node --expose-gc` (the `bench` script passes it).
 */
import { performance } from 'node:perf_hooks';
import type { BenchContext } from '../lib/context.js';
import { type LockUnderTest, palisadePostgres, palisadeRedis } from '../lib/locks.js';
import { closedLoop } from '../lib/measure.js';
import { ops, printTable } from '../lib/report.js';

const CLIENTS = 16;

function snapshot() {
  const gc = (globalThis as { gc?: () => void }).gc;
  gc?.();
  gc?.();
  const resources = process.getActiveResourcesInfo();
  const byType = new Map<string, number>();
  for (const r of resources) byType.set(r, (byType.get(r) ?? 0) + 1);
  return {
    heapMB: process.memoryUsage().heapUsed / 2 ** 20,
    handles: resources.length,
    byType: [...byType.entries()].map(([k, v]) => `${k} ${v}`).join(', '),
  };
}

async function cycles(lock: LockUnderTest, n: number, maxMs: number) {
  const per = Math.ceil(n / CLIENTS);
  const t0 = performance.now();
  const { iterations } = await closedLoop(CLIENTS, maxMs, per, async (w) => {
    const held = await lock.acquire(`mem-${w}`, 2_000, { autoExtend: true });
    await held.release();
  });
  return { done: iterations.reduce((a, b) => a + b, 0), ms: performance.now() - t0 };
}

export async function memory(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  if (!(globalThis as { gc?: unknown }).gc)
    report.note('memory: run without --expose-gc, heap numbers include garbage');
  const t = report.table('6. Memory (acquire/release with the watchdog on)', `${CLIENTS} clients, autoExtend: true`, [
    'lock',
    'cycles',
    'cycles/s',
    'heap MB start',
    'heap MB end',
    'handles start',
    'handles end',
    'handles at end by type',
  ]);
  const plans: [() => LockUnderTest, number][] = [
    [() => palisadeRedis(ctx, 'mem'), scale.memoryCycles],
    [() => palisadePostgres(ctx, 'mem'), Math.ceil(scale.memoryCycles / 10)],
  ];
  for (const [make, n] of plans) {
    const lock = make();
    try {
      await cycles(lock, 2_000, 30_000); // warm-up: scripts, statements, connections, JIT
      const start = snapshot();
      const run = await cycles(lock, n, 180_000);
      await new Promise((r) => setTimeout(r, 50));
      const end = snapshot();
      t.rows.push([
        lock.label,
        run.done.toLocaleString('en-US'),
        ops((run.done * 1000) / run.ms),
        start.heapMB.toFixed(1),
        end.heapMB.toFixed(1),
        start.handles,
        end.handles,
        end.byType,
      ]);
      if (run.done < n) t.notes.push(`${lock.label}: stopped at the time cap after ${run.done} of ${n} cycles.`);
      if (lock.label === 'palisade Redis') {
        const flat = end.heapMB - start.heapMB < 5 && end.handles <= start.handles;
        report.goal({
          section: '6',
          goal: `heap and handles flat over ${run.done.toLocaleString('en-US')} cycles with the watchdog (palisade Redis)`,
          measured: `heap ${start.heapMB.toFixed(1)} → ${end.heapMB.toFixed(1)} MB, handles ${start.handles} → ${end.handles}`,
          met: flat,
        });
      }
    } finally {
      await lock.close();
    }
  }
  t.notes.push(
    'Postgres lease runs a tenth of the cycles (each cycle is two committed writes). Heap after two forced GCs; handles = process.getActiveResourcesInfo().',
  );
  printTable(t);
}
