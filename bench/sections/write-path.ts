/**
 * Section 1 — the fenced write path, from the floor up:
 *
 * - raw postgres.js, prepared, plain `UPDATE … WHERE id = $1` (the floor);
 * - the same with the fence condition (`AND last_fence < $f`, sets last_fence);
 * - the same fenced UPDATE wrapped in the repository's why-refused CTE, sent
 *   raw (the exact text the repository sends), to price the outcome report;
 * - drizzle's query builder, built per call (fenced);
 * - drizzle `.prepare()` (fenced);
 * - `fencedRepository(...).update` (what palisade users call).
 *
 * Every fenced write uses a fresh, higher fence on a random row of 10,000,
 * so every write applies (the common case).
 */
import { and, sql as dsql, eq, fillPlaceholders, lt } from 'drizzle-orm';
import { PgDialect } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import type postgres from 'postgres';
import type { Database } from '../../src/driver.js';
import type { Fence } from '../../src/fencing/fence.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { updateStatements } from '../../src/repo/statements.js';
import { describeTable } from '../../src/repo/table.js';
import type { BenchContext } from '../lib/context.js';
import { type Case, compare, type Measured } from '../lib/measure.js';
import { ms, ops, printTable, ratio } from '../lib/report.js';
import { type Accounts, createAccounts, FenceCounter, makeAccounts, randomId } from '../lib/tables.js';

const ROWS = 10_000;

/** The exact SQL text and parameter order of the repository's `update` for a one-column patch. */
export function repositoryUpdateSql(table: Accounts): {
  text: string;
  params: (values: Record<string, unknown>) => unknown[];
} {
  const info = describeTable(table);
  const st = updateStatements(info, [['id', 1]], [['balance', 0]], 1n, 'reject').refusal;
  const query = new PgDialect().sqlToQuery(st.build());
  return { text: query.sql, params: (values) => fillPlaceholders(query.params, values) };
}

/** The write-path cases on `table` (which must exist with `rows` rows). */
export function writeCases(db: Database, sql: postgres.Sql, table: Accounts, name: string, rows: number): Case[] {
  const fences = new FenceCounter(1_000_000_000n);
  const repo = fencedRepository(db, table);
  const cte = repositoryUpdateSql(table);
  const prepared = db
    .update(table)
    .set({ balance: dsql`${dsql.placeholder('v')}`, lastFence: dsql`${dsql.placeholder('f')}` })
    .where(and(eq(table.id, dsql.placeholder('id')), lt(table.lastFence, dsql.placeholder('f'))))
    .prepare(`bench_${name}_update`);
  const value = () => Math.floor(Math.random() * 1_000_000);
  // Constant texts, sent as named (server-side prepared) statements: the fastest postgres.js path.
  const plainText = `update ${name} set balance = $1 where id = $2`;
  const fencedText = `update ${name} set balance = $1, last_fence = $3 where id = $2 and last_fence < $3`;
  return [
    {
      name: 'raw postgres.js: plain UPDATE (floor)',
      fn: () => sql.unsafe(plainText, [value(), randomId(rows)], { prepare: true }),
    },
    {
      name: 'raw postgres.js: fenced UPDATE',
      fn: () => sql.unsafe(fencedText, [value(), randomId(rows), String(fences.next())], { prepare: true }),
    },
    {
      name: 'raw postgres.js: fenced UPDATE … RETURNING *',
      fn: () =>
        sql.unsafe(`${fencedText} returning *`, [value(), randomId(rows), String(fences.next())], { prepare: true }),
    },
    {
      name: 'raw postgres.js: fenced UPDATE + why-refused CTE',
      fn: () =>
        sql.unsafe(cte.text, cte.params({ fence: fences.next(), k0: randomId(rows), v0: value() }) as never[], {
          prepare: true,
        }),
    },
    {
      name: 'raw postgres.js: the same CTE, unnamed statement',
      fn: () =>
        sql.unsafe(cte.text, cte.params({ fence: fences.next(), k0: randomId(rows), v0: value() }) as never[], {
          prepare: false,
        }),
    },
    {
      name: 'drizzle builder per call (fenced)',
      fn: () => {
        const f = fences.next();
        return db
          .update(table)
          .set({ balance: value(), lastFence: f })
          .where(and(eq(table.id, randomId(rows)), lt(table.lastFence, f)));
      },
    },
    {
      name: 'drizzle .prepare() (fenced)',
      fn: () => prepared.execute({ v: value(), f: fences.next(), id: randomId(rows) }),
    },
    {
      name: 'palisade repository.update',
      fn: async () => {
        const r = await repo.update({ id: randomId(rows) }, fences.next() as Fence, { balance: value() });
        // Two in-flight writes may hit the same row with fences in the other order: then one is stale.
        if (r.status !== 'applied' && r.status !== 'stale') throw new Error(`repository update: ${r.status}`);
      },
    },
  ];
}

const FLOOR = 0;
const FENCED = 1;
const RETURNING = 2;
const CTE = 3;
const REPO = 7;

export async function writePath(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const name = 'bench_accounts';
  await createAccounts(ctx.pg.sql, name, ROWS);
  const table = makeAccounts(name);
  // Commits without waiting for the WAL flush: the fsync is the same for every case and, on a shared
  // disk, swamps the differences this section is about (client work, round trips, the SQL itself).
  const sql = ctx.pg.client(24, { synchronous_commit: 'off' });
  const db = drizzle(sql) as unknown as Database;
  const cases = writeCases(db, sql, table, name, ROWS);
  const results: Record<string, Measured[]> = {};
  for (const concurrency of [1, 16]) {
    const label = concurrency === 1 ? 'serial' : `${concurrency} concurrent`;
    const m = await compare(cases, { concurrency, rounds: scale.rounds, timeMs: scale.timeMs });
    results[label] = m;
    const fenced = (m[FENCED] as Measured).opsPerSec;
    const floor = (m[FLOOR] as Measured).opsPerSec;
    const t = report.table('1. Fenced write path', `${label}, random row of ${ROWS.toLocaleString('en-US')}`, [
      'case',
      'ops/s',
      'p50 ms',
      'p99 ms',
      '× raw fenced',
      '× raw plain',
      'client CPU µs/op',
    ]);
    for (const r of m) {
      t.rows.push([
        r.name,
        ops(r.opsPerSec),
        ms(r.p50Ms),
        ms(r.p99Ms),
        ratio(r.opsPerSec / fenced),
        ratio(r.opsPerSec / floor),
        r.cpuUsPerCall.toFixed(0),
      ]);
    }
    t.notes.push(
      'All cases on one postgres.js client (24 connections) with synchronous_commit = off: the WAL flush is the same for every case and would swamp the differences on a shared disk.',
      'The repository sends the "why-refused CTE" text: one statement that also reports stale / duplicate / missing. "Unnamed statement" is what drizzle\'s postgres-js driver sends when a query has no name (postgres.js then parses and describes it in an extra round trip on every call) — how the repository ran before its driver module named its cached statements.',
    );
    printTable(t);
    const repoRatio = (m[REPO] as Measured).opsPerSec / fenced;
    report.goal({
      section: '1',
      goal: `repository ≥ 0.95× raw fenced UPDATE (${label})`,
      measured: ratio(repoRatio),
      met: repoRatio >= 0.95,
    });
    const fenceCost = 1 - fenced / floor;
    report.goal({
      section: '1',
      goal: `fence condition costs ≤ 5% over the plain UPDATE (${label})`,
      measured: `${(fenceCost * 100).toFixed(1)}%`,
      met: fenceCost <= 0.05,
    });
    const whyCost = 1 - (m[CTE] as Measured).opsPerSec / fenced;
    const returningCost = 1 - (m[RETURNING] as Measured).opsPerSec / fenced;
    report.goal({
      section: '1',
      goal: `why-refused CTE costs ≤ 10% over the fenced UPDATE (${label})`,
      measured: `${(whyCost * 100).toFixed(1)}% (of which RETURNING * alone: ${(returningCost * 100).toFixed(1)}%)`,
      met: whyCost <= 0.1,
    });
  }
  report.raw.writePath = results;
}
