/**
 * Lock-safe migrations: many replicas run `palisade migrate` at start-up and
 * every migration — palisade's own and the application's drizzle-kit folder
 * (test/fixtures/app) — is applied exactly once, and every replica exits 0.
 */
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { sql } from 'drizzle-orm';
import postgres from 'postgres';
import { afterEach, describe, expect, it } from 'vitest';
import { count, type Database, execute } from '../../src/driver.js';
import { InvalidArgumentError, LockUnavailableError, MigrationsFolderError } from '../../src/errors.js';
import { MIGRATE_LOCK_KEY, migrate } from '../../src/migrate.js';
import { killAllCli, runCli, startCli } from '../support/cli.js';
import { drivers, pgliteDatabase, postgresDatabase, type TestDatabase } from '../support/databases.js';
import {
  APP_MIGRATIONS,
  APPLIED_ONCE,
  appCount,
  migrateFromReplicas,
  objectCounts,
  palisadeCount,
  waitingMigrators,
} from '../support/migrate-replicas.js';
import { needs } from '../support/services.js';

afterEach(killAllCli);

describe.each(drivers)('migrate() with an application folder on $name', ({ open }) => {
  it('applies palisade then the app folder once, and a rerun applies nothing', async () => {
    const test = await open();
    try {
      const first = await migrate(test.db, { migrationsFolder: APP_MIGRATIONS });
      expect(first.applied.map((m) => m.folder)).toEqual([
        ...Array(palisadeCount).fill('palisade'),
        ...Array(appCount).fill('app'),
      ]);
      expect(first.applied.filter((m) => m.folder === 'app').map((m) => m.tag)).toEqual([
        '0000_create_widgets',
        '0001_fence_widgets',
        '0002_widgets_fence_trigger',
      ]);
      const again = await migrate(test.db, { migrationsFolder: APP_MIGRATIONS });
      expect(again.applied).toEqual([]);
      expect(again.skipped).toHaveLength(palisadeCount + appCount);
      expect(await objectCounts(test.db)).toEqual(APPLIED_ONCE);
    } finally {
      await test.close();
    }
  });
});

describe.runIf(needs('DATABASE_URL'))('palisade migrate from 8 processes at once (real Postgres)', () => {
  it('the fixture cannot be applied twice: a double apply would fail a replica', async () => {
    const test = await postgresDatabase();
    try {
      await migrate(test.db, { migrationsFolder: APP_MIGRATIONS });
      const first = readFileSync(`${APP_MIGRATIONS}/0000_create_widgets.sql`, 'utf8');
      await expect(test.db.execute(sql.raw(first))).rejects.toMatchObject({ cause: { code: '42P07' } });
    } finally {
      await test.close();
    }
  });

  // A database may default to a stricter isolation: a replica's snapshot must not predate the lock it waited for.
  // The strictest here; read committed and repeatable read in test-slow/migrate-isolation.test.ts.
  it(
    'at the default isolation serializable: all 8 exit 0 and each migration is applied exactly once',
    {
      timeout: 180_000,
    },
    () => migrateFromReplicas('serializable'),
  );

  it('a migrator whose connection is terminated while it waits says its migration failed, not that it cannot connect', async () => {
    const test = await postgresDatabase();
    const gate = postgres(test.url as string, { max: 1, onnotice: () => {} });
    try {
      await gate`select pg_advisory_lock(${MIGRATE_LOCK_KEY.toString()}::bigint)`;
      const cli = startCli(['migrate'], { DATABASE_URL: test.url });
      let waiter: number | undefined;
      // Bounded: at most 600 polls of 100 ms.
      for (let i = 0; i < 600 && waiter === undefined; i++) {
        waiter = (await waitingMigrators(gate))[0];
        if (waiter === undefined) await new Promise((r) => setTimeout(r, 100));
      }
      expect(waiter).toBeDefined();
      await gate`select pg_terminate_backend(${waiter as number})`;
      const run = await cli.done;
      expect(run.code).toBe(1);
      const last = run.stderr.trim().split('\n').at(-1);
      expect(last).toMatch(/^palisade migrate: migration failed, nothing applied: /);
      expect(last).not.toMatch(/cannot connect/);
    } finally {
      await gate.end({ timeout: 5 });
      await test.close();
    }
  });

  it('gives up with a clear error when another migrator holds the lock past lockTimeoutMs', async () => {
    const test = await postgresDatabase();
    const gate = postgres(test.url as string, { max: 1, onnotice: () => {} });
    try {
      await gate`select pg_advisory_lock(${MIGRATE_LOCK_KEY.toString()}::bigint)`;
      const progress: string[] = [];
      const error = await migrate(test.db, { lockTimeoutMs: 300, onProgress: (e) => progress.push(e.type) }).catch(
        (e: unknown) => e,
      );
      expect(error).toBeInstanceOf(LockUnavailableError);
      expect(progress).toEqual(['waiting']);
      const cli = await runCli(['migrate', '--lock-timeout', '0.3'], { DATABASE_URL: test.url });
      expect(cli.code).toBe(1);
      expect(cli.stderr.trim().split('\n').at(-1)).toMatch(
        /^palisade migrate: migration failed, nothing applied: lock "palisade:migrate" not acquired \(timeout\)/,
      );
      // Nothing of the refused runs was kept.
      const [row] =
        await gate`select count(*)::int as n from information_schema.schemata where schema_name = 'palisade'`;
      expect(row?.n).toBe(0);
    } finally {
      await gate.end({ timeout: 5 });
      await test.close();
    }
  });
});

describe('palisade migrate: usage errors', () => {
  it('says clearly that DATABASE_URL is needed, in one line, exit 1', async () => {
    const run = await runCli(['migrate'], { DATABASE_URL: undefined });
    expect(run.code).toBe(1);
    expect(run.stderr.trim().split('\n')).toHaveLength(1);
    expect(run.stderr).toMatch(/^palisade migrate: DATABASE_URL is not set/);
  });

  it('refuses a folder that is not a drizzle-kit folder, exit 2', async () => {
    const run = await runCli(['migrate', '--migrations-folder', 'test/fixtures'], {
      DATABASE_URL: 'postgres://127.0.0.1:1/none',
    });
    expect(run.code).toBe(2);
    expect(run.stderr).toMatch(/is not a drizzle-kit migrations folder/);
  });

  it("refuses palisade's own records table as --migrations-table, exit 2", async () => {
    const run = await runCli(['migrate', '--migrations-table', '__palisade_migrations'], {
      DATABASE_URL: 'postgres://127.0.0.1:1/none',
    });
    expect({ code: run.code, stderr: run.stderr }).toMatchObject({ code: 2, stderr: /is palisade's own/ });
  });
});

describe('migrate(): a bad folder is a setup error naming the path, before any query', () => {
  it('a missing folder, a folder without a journal, a journal naming a missing file, a bad option', async () => {
    const test = await pgliteDatabase();
    const dir = mkdtempSync(join(tmpdir(), 'palisade-migrations-'));
    try {
      const missing = join(dir, 'nope');
      const err = await migrate(test.db, { migrationsFolder: missing }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(MigrationsFolderError);
      expect(err).toMatchObject({ code: 'migrations_folder', folder: resolve(missing) });
      expect((err as Error).message).toContain(resolve(missing));

      // Regression: this was drizzle's "Can't find meta/_journal.json file", as a DatabaseError naming no path.
      const noJournal = await migrate(test.db, { migrationsFolder: dir }).catch((e: unknown) => e);
      expect(noJournal).toBeInstanceOf(MigrationsFolderError);
      expect((noJournal as Error).message).toMatch(/has no meta\/_journal\.json/);
      expect((noJournal as Error).message).toContain(dir);

      const meta = join(dir, 'meta');
      (await import('node:fs')).mkdirSync(meta);
      writeFileSync(
        join(meta, '_journal.json'),
        JSON.stringify({
          version: '7',
          dialect: 'postgresql',
          entries: [{ idx: 0, version: '7', when: 1, tag: '0000_gone', breakpoints: true }],
        }),
      );
      const gone = await migrate(test.db, { migrationsFolder: dir }).catch((e: unknown) => e);
      expect(gone).toBeInstanceOf(MigrationsFolderError);
      expect((gone as Error).message).toContain(dir);

      await expect(migrate(test.db, { migrationsFolder: '' })).rejects.toBeInstanceOf(InvalidArgumentError);
      // The app's records in palisade's own table: palisade's dates would have marked its migrations applied.
      await expect(
        migrate(test.db, { migrationsFolder: APP_MIGRATIONS, migrationsTable: '__palisade_migrations' }),
      ).rejects.toBeInstanceOf(InvalidArgumentError);
      // None of it reached the database: not even palisade's own migrations ran.
      const [row] = await execute(
        test.db,
        sql`select count(*) as n from information_schema.schemata where schema_name = 'palisade'`,
      );
      expect(count(row?.n)).toBe(0);
    } finally {
      rmSync(dir, { recursive: true, force: true });
      await test.close();
    }
  });
});

describe("migrate() inside the caller's own transaction", () => {
  it.each(['read committed', 'repeatable read', 'serializable'] as const)(
    'keeps the level the caller chose (%s) and applies',
    async (isolationLevel) => {
      const test = await pgliteDatabase();
      try {
        const applied = await test.db.transaction(
          async (tx) => {
            await tx.execute(sql`select 1`);
            return (await migrate(tx as unknown as Database)).applied.length;
          },
          { isolationLevel },
        );
        expect(applied).toBe(palisadeCount);
      } finally {
        await test.close();
      }
    },
  );
});

describe.runIf(needs('DATABASE_URL'))('migrate() on postgres.js emits no NOTICE', () => {
  it('a rerun (every "if not exists" skipped) prints nothing through onnotice', async () => {
    const test = await postgresDatabase();
    const notices: unknown[] = [];
    const client = postgres(test.url as string, { max: 1, onnotice: (n) => void notices.push(n) });
    try {
      const { drizzle } = await import('drizzle-orm/postgres-js');
      const db = drizzle(client) as unknown as TestDatabase['db'];
      await migrate(db, { migrationsFolder: APP_MIGRATIONS });
      await migrate(db, { migrationsFolder: APP_MIGRATIONS });
      expect(notices).toEqual([]);
      // The setting was the migration's own: this session is back to notices.
      await client.unsafe('create schema if not exists drizzle');
      expect(notices).toHaveLength(1);
    } finally {
      await client.end({ timeout: 5 });
      await test.close();
    }
  });
});
