/**
 * `palisade migrate` from several replicas at once, as at a deployment's
 * start-up: test/cli/migrate.test.ts runs it at one default isolation,
 * test-slow/migrate-isolation.test.ts at the others.
 */
import { type SQL, sql } from 'drizzle-orm';
import { readMigrationFiles } from 'drizzle-orm/migrator';
import postgres from 'postgres';
import { expect } from 'vitest';
import { count, execute } from '../../src/driver.js';
import { MIGRATE_LOCK_KEY, PALISADE_MIGRATIONS } from '../../src/migrate.js';
import { runCli, startCli } from './cli.js';
import { postgresDatabase, type TestDatabase } from './databases.js';

/** The application's drizzle-kit folder the migrations tests apply after palisade's own. */
export const APP_MIGRATIONS = 'test/fixtures/app/drizzle';

/** The backends of this database queued for an advisory lock (the migration lock, in these tests). */
export async function waitingMigrators(gate: postgres.Sql): Promise<number[]> {
  const rows = await gate`
    select pid from pg_locks where locktype = 'advisory' and not granted
      and database = (select oid from pg_database where datname = current_database())`;
  return rows.map((r) => Number(r.pid));
}

/** How many migrations palisade's folder and the application's hold. */
export const palisadeCount = readMigrationFiles({ migrationsFolder: PALISADE_MIGRATIONS }).length;
export const appCount = readMigrationFiles({ migrationsFolder: APP_MIGRATIONS }).length;
const REPLICAS = 8;

interface Summary {
  applied: { folder: string; tag: string }[];
  skipped: unknown[];
  waited: boolean;
}

/** What {@link objectCounts} finds once every migration of both folders is applied exactly once. */
export const APPLIED_ONCE = {
  palisadeRecorded: palisadeCount,
  palisadeDistinct: palisadeCount,
  appRecorded: appCount,
  appDistinct: appCount,
  fenceColumns: 2,
  triggers: 2,
  leaseTables: 1,
};

/** What the database holds of both folders' migrations (compared with {@link APPLIED_ONCE}). */
export async function objectCounts(db: TestDatabase['db']) {
  const one = async (query: SQL) => count((await execute(db, query))[0]?.n);
  return {
    palisadeRecorded: await one(sql`select count(*) as n from drizzle.__palisade_migrations`),
    palisadeDistinct: await one(sql`select count(distinct hash) as n from drizzle.__palisade_migrations`),
    appRecorded: await one(sql`select count(*) as n from drizzle.__drizzle_migrations`),
    appDistinct: await one(sql`select count(distinct hash) as n from drizzle.__drizzle_migrations`),
    fenceColumns: await one(
      sql`select count(*) as n from information_schema.columns where table_name = 'widgets' and column_name in ('last_fence', 'deleted_at')`,
    ),
    triggers: await one(
      sql`select count(*) as n from pg_trigger where tgrelid = 'widgets'::regclass and tgname like 'palisade_fence_guard%'`,
    ),
    leaseTables: await one(
      sql`select count(*) as n from information_schema.tables where table_schema = 'palisade' and table_name = 'leases'`,
    ),
  };
}

/**
 * Eight replicas run `palisade migrate` on a database whose default isolation is `isolation`, all queued on
 * the migration lock before it opens: all exit 0, exactly one applies every migration, the others skip them,
 * and a rerun applies nothing. A stricter default must not give a replica a snapshot older than the lock it
 * waited for. The caller kills what is left (`killAllCli`).
 */
export async function migrateFromReplicas(isolation: string): Promise<void> {
  const test = await postgresDatabase();
  const dbName = new URL(test.url as string).pathname.slice(1);
  await test.db.execute(sql.raw(`alter database "${dbName}" set default_transaction_isolation = '${isolation}'`));
  // The gate holds the migration lock while the replicas start, so all 8
  // are provably inside migrate() and queued on the lock when it opens.
  const gate = postgres(test.url as string, { max: 1, onnotice: () => {} });
  try {
    await gate`select pg_advisory_lock(${MIGRATE_LOCK_KEY.toString()}::bigint)`;
    const replicas = Array.from({ length: REPLICAS }, () =>
      startCli(['migrate', '--migrations-folder', APP_MIGRATIONS, '--json'], { DATABASE_URL: test.url }),
    );
    let exitedEarly = false;
    for (const r of replicas) r.done.then(() => (exitedEarly = true)).catch(() => (exitedEarly = true));
    let waiting = 0;
    // Bounded: at most 600 polls of 100 ms (a minute on a slow machine).
    for (let i = 0; i < 600 && waiting < REPLICAS && !exitedEarly; i++) {
      waiting = (await waitingMigrators(gate)).length;
      if (waiting < REPLICAS) await new Promise((r) => setTimeout(r, 100));
    }
    expect(exitedEarly).toBe(false);
    expect(waiting).toBe(REPLICAS);
    await gate`select pg_advisory_unlock(${MIGRATE_LOCK_KEY.toString()}::bigint)`;

    const runs = await Promise.all(replicas.map((r) => r.done));
    for (const run of runs) expect({ code: run.code, stderr: run.stderr }).toMatchObject({ code: 0 });
    const summaries = runs.map((run) => JSON.parse(run.stdout) as Summary);
    // Every replica waited on the gate; exactly one applied everything, the others nothing.
    expect(summaries.every((s) => s.waited)).toBe(true);
    const appliers = summaries.filter((s) => s.applied.length > 0);
    expect(appliers).toHaveLength(1);
    expect(appliers[0]?.applied).toHaveLength(palisadeCount + appCount);
    for (const s of summaries.filter((x) => x.applied.length === 0)) {
      expect(s.skipped).toHaveLength(palisadeCount + appCount);
    }
    expect(await objectCounts(test.db)).toEqual(APPLIED_ONCE);

    const rerun = await runCli(['migrate', '--migrations-folder', APP_MIGRATIONS], { DATABASE_URL: test.url });
    expect(rerun.code).toBe(0);
    expect(rerun.stdout).toContain(`up to date: ${palisadeCount + appCount} migrations already applied`);
  } finally {
    await gate.end({ timeout: 5 });
    await test.close();
  }
}
