/**
 * telemetry — the demo's story, watched through OpenTelemetry.
 *
 * The story (as `npm run demo`, act 2): worker A takes the lock `counter`
 * and stalls — a GC pause, a throttled container — past its lease's TTL.
 * Worker B takes the lock with a higher fence and increments the counter.
 * A wakes up, still believing it holds the lock, and writes with its old
 * fence: Postgres refuses it.
 *
 * What you see: palisade's spans as they end (acquire, release, every write
 * as `UPDATE visits` with its fence and outcome — A's with outcome `stale`),
 * then the metrics: one refused write (`palisade.write.refused`, outcome
 * `stale`), A's lost lease (`palisade.lock.lost`, reason `ttl_expired`),
 * the grants and the acquire waits. Exported to the console with the
 * OpenTelemetry SDK's console exporters; in production you would register
 * an OTLP exporter instead and alert on `palisade.write.refused` and
 * `palisade.lock.lost`.
 *
 * The two workers are two leases in one process here (the demo uses two
 * processes and SIGSTOP): what telemetry records is the same.
 *
 * Run it (embedded PGlite, no server needed; needs the SDK packages
 * `@opentelemetry/sdk-metrics` and `@opentelemetry/sdk-trace-base`):
 *
 *   npx tsx examples/telemetry/index.ts
 */
import { PGlite } from '@electric-sql/pglite';
import { metrics, trace } from '@opentelemetry/api';
import {
  AggregationTemporality,
  ConsoleMetricExporter,
  MeterProvider,
  PeriodicExportingMetricReader,
} from '@opentelemetry/sdk-metrics';
import { BasicTracerProvider, ConsoleSpanExporter, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/pglite';
import { type Database, fenceColumns, fencedRepository, migrate, postgresLockManager } from 'palisade-db';
import { isMain } from '../shared.js';

export const visits = pgTable('visits', {
  id: text('id').primaryKey(),
  count: integer('count').notNull(),
  ...fenceColumns(),
});

const TTL_MS = 300;

/** What the story ended with, for the test. */
export interface TelemetryStory {
  readonly late: string;
  readonly count: number;
}

/** Registers the OpenTelemetry SDK globally, exporting to the console. Returns what flushes and shuts it down. */
export function registerConsoleSdk(): { shutdown(): Promise<void> } {
  const reader = new PeriodicExportingMetricReader({
    exporter: new ConsoleMetricExporter({ temporalitySelector: () => AggregationTemporality.CUMULATIVE }),
    exportIntervalMillis: 3_600_000, // exported once, at shutdown
  });
  const meterProvider = new MeterProvider({ readers: [reader] });
  const tracerProvider = new BasicTracerProvider({
    spanProcessors: [new SimpleSpanProcessor(new ConsoleSpanExporter())],
  });
  metrics.setGlobalMeterProvider(meterProvider);
  trace.setGlobalTracerProvider(tracerProvider);
  return {
    async shutdown() {
      await meterProvider.shutdown(); // the last export
      await tracerProvider.shutdown();
    },
  };
}

/** The story on `db` (palisade migrated, `visits` created). */
export async function story(db: Database, say: (line: string) => void): Promise<TelemetryStory> {
  const locks = postgresLockManager({ client: db, namespace: 'telemetry-example', listen: false });
  const repo = fencedRepository(db, visits);
  try {
    const a = await locks.acquire('counter', { ttlMs: TTL_MS, holder: 'A' });
    say(`A  took the lock "counter" with fence ${a.fence}`);
    // A stalls past its TTL: nobody extends the lease, its local deadline passes.
    await new Promise<void>((resolve) => a.signal.addEventListener('abort', () => resolve(), { once: true }));
    say('A  stalled past its TTL: its lease is lost (A does not know yet)');
    const b = await locks.acquire('counter', { ttlMs: 5_000, holder: 'B' });
    const wrote = await repo.update({ id: 'home' }, b.fence, { count: sql`${visits.count} + 1` });
    say(`B  took the lock with fence ${b.fence}; its increment: ${wrote.status}`);
    await b.release();
    // A wakes up and writes with the fence it was given.
    const late = await repo.update({ id: 'home' }, a.fence, { count: sql`${visits.count} + 1` });
    say(`A  woke up and wrote with fence ${a.fence}: ${late.status.toUpperCase()} — the database refused it`);
    await a.release();
    const [row] = await db.select().from(visits);
    return { late: late.status, count: row?.count ?? -1 };
  } finally {
    await locks.close();
  }
}

async function main(): Promise<void> {
  const sdk = registerConsoleSdk();
  const client = new PGlite();
  const db = drizzle(client) as unknown as Database;
  try {
    await migrate(db);
    await db.execute(
      sql`create table visits (id text primary key, count integer not null, last_fence bigint not null default 0, deleted_at timestamptz)`,
    );
    await db.execute(sql`insert into visits (id, count) values ('home', 0)`);
    const result = await story(db, (line) => console.log(`--- ${line}`));
    console.log(`--- result: count = ${result.count}; A's late write: ${result.late}. Metrics follow.`);
  } finally {
    await sdk.shutdown();
    await client.close();
  }
}

if (isMain(import.meta.url)) {
  main().catch((err) => {
    console.error(err);
    process.exitCode = 1;
  });
}
