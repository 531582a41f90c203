/**
 * What postgres.js 3.4.9 does when the server ends a connection while the
 * connection's first statement is in flight (README, "When the connection
 * closes inside a transaction" — the driver faults it names), in a process
 * of its own: with the default `fetch_types` the first statement is the
 * driver's own array-type query, and its failure escapes as an unhandled
 * rejection, which ends a Node process; with `fetch_types: false` nothing
 * escapes. Either way the killed backend's error is replayed onto the first
 * query after the reconnect, and a retry goes through. Pins the driver's
 * behaviour behind the README's advice: when an upgrade changes it, this
 * fails and the advice is revisited. Last, what the advice costs: nothing
 * for drizzle's array columns, which palisade writes and reads back without
 * the driver's array types.
 */
import { execFile } from 'node:child_process';
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { describe, expect, it, onTestFinished } from 'vitest';
import { connect } from '../../src/cli/common.js';
import { postgresOptions } from '../../src/cli/demo-shared.js';
import type { Database } from '../../src/driver.js';
import { toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { createScratchDatabase } from '../support/scratch-database.js';
import { needs } from '../support/services.js';

const run = promisify(execFile);
const FIXTURE = fileURLToPath(new URL('../fixtures/kill-at-connect.mjs', import.meta.url));

interface Outcome {
  transaction: string;
  unhandled: string[];
  after: string[];
}

async function killAtConnect(fetchTypes: 'on' | 'off'): Promise<Outcome> {
  const { stdout } = await run(process.execPath, [FIXTURE, process.env.DATABASE_URL ?? '', fetchTypes], {
    timeout: 30_000,
  });
  return JSON.parse(stdout.trim().split('\n').at(-1) ?? '{}') as Outcome;
}

describe.runIf(needs('DATABASE_URL'))('postgres.js: a connection killed while its first statement is in flight', () => {
  it('with fetch_types: false the transaction call rejects and nothing escapes; the next query gets the old error once', async () => {
    const outcome = await killAtConnect('off');
    expect(outcome.transaction).toMatch(/^rejected /);
    expect(outcome.unhandled).toEqual([]);
    expect(outcome.after).toEqual(['rejected 57P01', 'ok']);
  });

  it('with the default fetch_types the array-type fetch is what was killed, and its rejection escapes unhandled', async () => {
    const outcome = await killAtConnect('on');
    expect(outcome.transaction).toMatch(/^rejected /);
    expect(outcome.unhandled).toEqual(['57P01']);
    expect(outcome.after).toEqual(['ok', 'ok']);
  });
});

describe.runIf(needs('DATABASE_URL'))('postgres.js with fetch_types: false, as the README advises', () => {
  it('array columns round-trip through update, modify and upsert, the row back as arrays', async () => {
    const { url, drop } = await createScratchDatabase(process.env.DATABASE_URL ?? '');
    const client = postgres(url, { max: 2, fetch_types: false, onnotice: () => {} });
    onTestFinished(async () => {
      await client.end({ timeout: 1 });
      await drop();
    });
    const db = drizzle(client) as unknown as Database;
    await migrate(db);
    await db.execute(
      sql.raw(`create table tagged (id text primary key, tags text[], scores int[],
        last_fence bigint not null default 0, deleted_at timestamptz)`),
    );
    await db.execute(sql.raw(`insert into tagged (id, tags, scores) values ('a', '{x}', '{1}')`));
    const repo = fencedRepository(
      db,
      pgTable('tagged', {
        id: text('id').primaryKey(),
        tags: text('tags').array(),
        scores: integer('scores').array(),
        ...fenceColumns(),
      }),
    );
    const updated = await repo.update({ id: 'a' }, toFence(1n), { tags: ['red', 'a,b', 'q"t'], scores: [2, 3] });
    expect(updated.status).toBe('applied');
    if (updated.status === 'applied')
      expect(updated.row).toMatchObject({ tags: ['red', 'a,b', 'q"t'], scores: [2, 3] });
    const modified = await repo.modify({ id: 'a' }, toFence(2n), (row) => ({
      tags: [...(row.tags ?? []), 'blue'],
      scores: (row.scores ?? []).map((n) => n * 10),
    }));
    expect(modified.status).toBe('applied');
    if (modified.status === 'applied') {
      expect(modified.row).toMatchObject({ tags: ['red', 'a,b', 'q"t', 'blue'], scores: [20, 30] });
    }
    expect((await repo.upsert({ id: 'b', tags: ['new'], scores: [] }, toFence(3n))).status).toBe('applied');
    const stored =
      await client`select id, to_json(tags)::text as tags, to_json(scores)::text as scores from tagged order by id`;
    expect(stored.map((r) => ({ ...r }))).toEqual([
      { id: 'a', tags: '["red","a,b","q\\"t","blue"]', scores: '[20,30]' },
      { id: 'b', tags: '["new"]', scores: '[]' },
    ]);
  });
});

/** Each place in src/ that creates a postgres.js client, with the text of its call. */
function clientCalls(dir: string): { file: string; call: string }[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const file = join(dir, entry.name);
    if (entry.isDirectory()) return clientCalls(file);
    if (!entry.name.endsWith('.ts')) return [];
    const text = readFileSync(file, 'utf8').replace(/^\s*(\/\/|\*).*$/gm, ''); // without comment lines
    // `postgres(…)` or `(factory as typeof postgres)(…)`, not a local function named postgres called with a label.
    return [...text.matchAll(/(?<!function )\bpostgres\((?!')|typeof postgres\)\(/g)].map((m) => {
      let depth = 0;
      let end = (m.index ?? 0) + m[0].length - 1;
      for (; end < text.length; end++) {
        if (text[end] === '(') depth++;
        else if (text[end] === ')' && --depth === 0) break;
      }
      return { file, call: text.slice(m.index, end + 1) };
    });
  });
}

describe('every postgres.js client palisade creates skips the array-type fetch (fetch_types: false)', () => {
  it("the CLI connection and the demo workers' options say so", async () => {
    const cli = await connect('postgres://nobody@127.0.0.1:1/none'); // connects lazily: nothing is sent
    try {
      expect(cli.options.fetch_types).toBe(false);
    } finally {
      await cli.end({ timeout: 0 });
    }
    expect(postgresOptions({ kind: 'url', url: 'postgres://x@127.0.0.1/x', schema: 's' } as never).fetch_types).toBe(
      false,
    );
    expect(postgresOptions({ kind: 'socket', dir: '/tmp', port: 5432 } as never).fetch_types).toBe(false);
  });

  it('so does every call in src/ that creates one', () => {
    const calls = clientCalls('src');
    expect(calls.length).toBeGreaterThanOrEqual(5); // the CLI, the demo's stage and workers, the advisory session
    for (const { file, call } of calls) {
      expect({ file, skips: /fetch_types: false|postgresOptions\(/.test(call) }).toEqual({ file, skips: true });
    }
  });
});
