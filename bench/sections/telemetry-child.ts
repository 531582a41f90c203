/**
 * One measurement of section 8 in a process of its own: one telemetry
 * configuration from the start, so the JIT never sees another (switching
 * configurations inside one process deoptimises the hooks at every switch
 * and measures that instead). Prints `{ cpuUs, calls, wallMs }` as JSON.
 * argv[2]: JSON { mode, workload, ms, redisUrl, namespace, databaseUrl, table }.
 */
import { performance } from 'node:perf_hooks';
import { MeterProvider } from '@opentelemetry/sdk-metrics';
import { BasicTracerProvider } from '@opentelemetry/sdk-trace-base';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import type { Database } from '../../src/driver.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import type { Fence } from '../../src/fencing/fence.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { observeAcquire, observeRelease } from '../../src/telemetry/locks.js';
import { configureTelemetry, setTelemetryLoaded } from '../../src/telemetry/otel.js';
import { observeWrite } from '../../src/telemetry/writes.js';
import { FenceCounter, makeAccounts, randomId } from '../lib/tables.js';

export interface ChildArgs {
  readonly mode: 'without it' | 'without it, again' | 'api, no SDK' | 'SDK registered';
  /** `cycle` / `write`: the real operation. `hooks-cycle` / `hooks-write`: the instrumentation alone, around operations that do nothing. */
  readonly workload: 'cycle' | 'write' | 'hooks-cycle' | 'hooks-write';
  readonly ms: number;
  readonly redisUrl: string;
  readonly namespace: string;
  readonly databaseUrl: string;
  readonly table: string;
  readonly rows: number;
  /** Fences for writes start here (above every earlier child's). */
  readonly fenceBase: string;
}

const args = JSON.parse(process.argv[2] ?? '{}') as ChildArgs;
if (args.mode === 'without it' || args.mode === 'without it, again') setTelemetryLoaded(false);
const meterProvider = new MeterProvider();
const tracerProvider = new BasicTracerProvider();
if (args.mode === 'SDK registered') configureTelemetry({ meterProvider, tracerProvider });

const sql = postgres(args.databaseUrl, { max: 2, onnotice: () => {}, connection: { synchronous_commit: 'off' } });
const db = drizzle(sql) as unknown as Database;
const redis = new Redis(args.redisUrl, { commandTimeout: 5_000 });
const locks = redisLockManager({ client: redis, namespace: args.namespace, epochs: db });
const repo = fencedRepository(db, makeAccounts(args.table));
const fences = new FenceCounter(BigInt(args.fenceBase));
const lease = { fence: 5n };
const ops: Record<ChildArgs['workload'], () => Promise<unknown>> = {
  cycle: async () => (await locks.acquire('otel', { ttlMs: 10_000, waitMs: 2_000 })).release(),
  write: () => repo.update({ id: randomId(args.rows) }, fences.next() as Fence, { balance: 1 }),
  'hooks-cycle': async () => {
    await observeAcquire('redis', 'otel', async () => lease);
    return observeRelease('redis', 'otel', 5n, 0, async () => 'released' as const);
  },
  'hooks-write': () => observeWrite('bench_otel', 'update', 'UPDATE', 5n, async () => ({ status: 'applied' as const })),
};
const op = ops[args.workload];

try {
  const warmUntil = performance.now() + Math.min(1_000, args.ms / 2);
  for (let i = 0; i < 300 || performance.now() < warmUntil; i++) await op();
  // The hooks alone take well under a microsecond: time many calls per read of the CPU clock.
  const batch = args.workload.startsWith('hooks') ? 1_000 : 1;
  const until = performance.now() + args.ms;
  const t0 = performance.now();
  const c0 = process.cpuUsage();
  let calls = 0;
  while (performance.now() < until) {
    for (let i = 0; i < batch; i++) await op();
    calls += batch;
  }
  const c = process.cpuUsage(c0);
  process.stdout.write(
    `${JSON.stringify({ cpuUs: (c.user + c.system) / calls, calls, wallMs: performance.now() - t0 })}\n`,
  );
} finally {
  await locks.close();
  redis.disconnect();
  await sql.end({ timeout: 5 });
  await meterProvider.shutdown();
  await tracerProvider.shutdown();
}
