/**
 * `palisade fence-trigger TABLE` prints SQL for a drizzle-kit custom
 * migration; appended to the file drizzle-kit prepares, it installs a
 * working guard.
 */
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { sql } from 'drizzle-orm';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { execute } from '../../src/driver.js';
import { DatabaseError } from '../../src/errors.js';
import { migrate } from '../../src/migrate.js';
import { FENCE_TRIGGER_SQLSTATE, fenceTriggerSql } from '../../src/schema/fence-trigger.js';
import { killAllCli, runCli } from '../support/cli.js';
import { pgliteDatabase, type TestDatabase } from '../support/databases.js';

afterEach(killAllCli);

describe('palisade fence-trigger', () => {
  let test: TestDatabase;
  beforeAll(async () => {
    test = await pgliteDatabase();
  });
  afterAll(async () => {
    await test?.close();
  });

  it('prints the migration SQL that, after drizzle-kit’s custom-file comment, installs the guard', async () => {
    const run = await runCli(['fence-trigger', 'orders', '--schema', 'shop']);
    expect(run.code).toBe(0);
    expect(run.stdout).toBe(
      `\n--> statement-breakpoint\n-- palisade fence trigger on shop.orders\n${fenceTriggerSql({ schema: 'shop', name: 'orders' })}\n`,
    );
    // What `drizzle-kit generate --custom` leaves, then `>>` the CLI's output, split as drizzle's migrator does.
    const file = `-- Custom SQL migration file, put your code below! --${run.stdout}`;
    await execute(test.db, sql`create schema shop`);
    await execute(
      test.db,
      sql`create table shop.orders (id int primary key, total int not null, last_fence bigint not null default 0, deleted_at timestamptz)`,
    );
    for (const statement of file.split('--> statement-breakpoint').slice(1)) {
      await execute(test.db, sql.raw(statement));
    }
    await execute(test.db, sql`insert into shop.orders (id, total) values (1, 10)`);
    const error = await execute(test.db, sql`update shop.orders set total = 0`).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(DatabaseError);
    expect((error as DatabaseError).sqlState).toBe(FENCE_TRIGGER_SQLSTATE);
  });

  it('passes --same-fence and --allow-deletes through, and refuses bad usage with exit 2', async () => {
    const allow = await runCli(['fence-trigger', 't', '--same-fence', 'allow', '--allow-deletes']);
    expect(allow.stdout).toContain(
      `\n${fenceTriggerSql({ name: 't' }, { sameFence: 'allow', guardDeletes: false })}\n`,
    );
    const none = await runCli(['fence-trigger']);
    expect([none.code, none.stderr]).toEqual([
      2,
      'palisade fence-trigger: name exactly one table (see: palisade fence-trigger --help)\n',
    ]);
    const bad = await runCli(['fence-trigger', 't', '--same-fence', 'sometimes']);
    expect([bad.code, bad.stderr]).toEqual([2, 'palisade fence-trigger: --same-fence must be reject or allow\n']);
  });

  // Regression: the output did not start with a statement breakpoint, so a second table's SQL
  // appended to the same file ran in one statement with the first's last one, and failed.
  it('appended for two tables to one custom migration, migrate() installs both guards', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'palisade-fence-trigger-'));
    try {
      mkdirSync(join(dir, 'meta'));
      const entries = ['0000_tables', '0001_fence_triggers'].map((tag, idx) => ({
        idx,
        version: '7',
        when: 1_700_000_000_000 + idx,
        tag,
        breakpoints: true,
      }));
      writeFileSync(
        join(dir, 'meta', '_journal.json'),
        JSON.stringify({ version: '7', dialect: 'postgresql', entries }),
      );
      const table = (name: string) =>
        `CREATE TABLE "${name}" (id int primary key, n int not null, last_fence bigint not null default 0, deleted_at timestamptz);`;
      writeFileSync(join(dir, '0000_tables.sql'), `${table('first')}\n--> statement-breakpoint\n${table('second')}\n`);
      let custom = '-- Custom SQL migration file, put your code below! --';
      for (const name of ['first', 'second']) {
        const run = await runCli(['fence-trigger', name]);
        expect(run.code).toBe(0);
        custom += run.stdout; // `>>`
      }
      writeFileSync(join(dir, '0001_fence_triggers.sql'), custom);
      // On the suite's PGlite: the tables "first" and "second" are this test's own.
      await migrate(test.db, { migrationsFolder: dir });
      for (const name of ['first', 'second']) {
        await execute(test.db, sql.raw(`insert into "${name}" (id, n) values (1, 1)`));
        const error = await execute(test.db, sql.raw(`update "${name}" set n = 2`)).catch((e: unknown) => e);
        expect((error as DatabaseError).sqlState).toBe(FENCE_TRIGGER_SQLSTATE);
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('refuses a table or schema name with a control character: exit 2, no SQL printed', async () => {
    // The name goes into a `-- …` comment line: a newline in it would end the comment and run the rest as SQL.
    for (const args of [
      ['fence-trigger', 'orders\nDROP TABLE victims; --'],
      ['fence-trigger', 'orders\rDROP TABLE victims; --'],
      ['fence-trigger', 'orders', '--schema', 'shop\nDROP TABLE victims; --'],
      ['fence-trigger', 'orders\u2028DROP TABLE victims; --'],
    ]) {
      const run = await runCli(args);
      expect(run.code).toBe(2);
      expect(run.stdout).toBe('');
      expect(run.stderr).toMatch(/^palisade fence-trigger: .*control character.*\n$/);
      expect(run.stderr).not.toContain('DROP TABLE');
    }
  });

  it("refuses drizzle's statement-breakpoint text in a name, an empty table name and an empty --schema: exit 2, no SQL", async () => {
    // drizzle's migrator splits a file at the breakpoint text even inside a quoted name.
    for (const [args, message] of [
      [['fence-trigger', 'w--> statement-breakpoint DROP TABLE victims; --'], /statement-breakpoint/],
      [['fence-trigger', 'orders', '--schema', 'x--> statement-breakpoint'], /statement-breakpoint/],
      [['fence-trigger', ''], /table name is empty/],
      [['fence-trigger', 'orders', '--schema', ''], /--schema is empty/],
    ] as const) {
      const run = await runCli([...args]);
      expect(run.code).toBe(2);
      expect(run.stdout).toBe('');
      expect(run.stderr).toMatch(message);
      expect(run.stderr).not.toContain('DROP TABLE');
    }
  });
});
