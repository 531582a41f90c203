/**
 * Migration 0011 (register keys by namespace) on a live database: its table
 * rewrite waits at most 2 s for the lock on `palisade.lock_registers`, so a
 * session that holds the table (a paused holder stalled mid-statement, here
 * an open transaction) cannot make every grant and lock-scoped write queue
 * behind the migration. It fails, changes nothing, and runs again later.
 */
import { readFileSync } from 'node:fs';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';

const journal = JSON.parse(readFileSync('drizzle/meta/_journal.json', 'utf8')) as { entries: { tag: string }[] };
const statements = (tag: string) =>
  readFileSync(`drizzle/${tag}.sql`, 'utf8')
    .split('--> statement-breakpoint')
    .filter((s) => s.trim() !== '');

describe.runIf(needs('DATABASE_URL'))('migration 0011 beside a session that holds the register table', () => {
  let test: TestDatabase;
  let client: postgres.Sql;

  beforeAll(async () => {
    test = await postgresDatabase({ migrated: false });
    client = postgres(test.url as string, { max: 3, onnotice: () => {} });
    const tags = journal.entries.map((e) => e.tag);
    for (const tag of tags.slice(0, tags.indexOf('0011_register_keys_by_namespace'))) await migrateTo(tag);
    await client`select palisade.register_grant('postgres', 'ns', 'L', 7)`;
  });
  afterAll(async () => {
    await client?.end({ timeout: 2 });
    await test?.close();
  });

  // As migrate() applies one: in a transaction.
  const migrateTo = (tag: string) =>
    client.begin(async (tx) => {
      for (const s of statements(tag)) await tx.unsafe(s);
    });
  const migrate0011 = () => migrateTo('0011_register_keys_by_namespace');
  const keyOf = async () =>
    (await client`select lock_key::text as key from palisade.lock_registers where name = 'L'`)[0]?.key;

  it('fails with 55P03 after its lock wait, changing nothing, and applies once the session is gone', async () => {
    const before = await keyOf();
    const blocker = await client.reserve();
    await blocker`begin`;
    await blocker`select fence from palisade.lock_registers where name = 'L'`; // holds the table till its end
    const failed = await migrate0011().catch((e: unknown) => e);
    expect((failed as { code?: string }).code).toBe('55P03');
    expect(await keyOf()).toBe(before);
    // The lock wait was the migration's own: the session keeps its default.
    expect((await client`show lock_timeout`)[0]?.lock_timeout).toBe('0');

    await blocker`rollback`;
    blocker.release();
    await migrate0011();
    const [row] = await client`select palisade.lock_key('postgres', source, 'ns', 'L')::text as key
      from palisade.lock_registers where name = 'L'`;
    expect(await keyOf()).toBe(row?.key);
    expect(await keyOf()).not.toBe(before);
    expect((await client`show lock_timeout`)[0]?.lock_timeout).toBe('0');
  });
});
