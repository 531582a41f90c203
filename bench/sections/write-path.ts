/**
 * Section 1 — the fenced write path, from the floor up:
 *
 * - raw postgres.js, prepared, plain `UPDATE … WHERE id = $1` (the floor);
 * - the same with the fence condition (`AND last_fence < $f`, sets last_fence);
 * - the repository's refusal statement (the fenced UPDATE tried again beside a
 *   read of the previous row), sent raw: what a write that did not apply
 *   costs in its second round trip — here it applies, to price the statement;
 * - drizzle's query builder, built per call (fenced);
 * - drizzle `.prepare()` (fenced);
 * - `fencedRepository(...).update` (what palisade users call): returning the
 *   row, returning the status only, and with an SQL expression in the patch.
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
import { type Case, compare, type Measured, pairedRatio } from '../lib/measure.js';
import { comparedCells, printTable, ratio } from '../lib/report.js';
import { type Accounts, createAccounts, FenceCounter, makeAccounts, randomId } from '../lib/tables.js';

const ROWS = 10_000;

/** The exact SQL text and parameter order of the repository's refusal statement for a one-column `update`. */
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
      // The same case again: its ratio to the first shows how far noise alone moves a ratio.
      name: 'raw postgres.js: fenced UPDATE, again (A/A control)',
      fn: () => sql.unsafe(fencedText, [value(), randomId(rows), String(fences.next())], { prepare: true }),
    },
    {
      name: 'raw postgres.js: fenced UPDATE … RETURNING *',
      fn: () =>
        sql.unsafe(`${fencedText} returning *`, [value(), randomId(rows), String(fences.next())], { prepare: true }),
    },
    {
      name: 'raw postgres.js: the refusal statement (CTE)',
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
    {
      name: "palisade repository.update, returning: 'status'",
      fn: async () => {
        const r = await repo.update(
          { id: randomId(rows) },
          fences.next() as Fence,
          { balance: value() },
          {
            returning: 'status',
          },
        );
        if (r.status !== 'applied' && r.status !== 'stale') throw new Error(`repository update: ${r.status}`);
      },
    },
    {
      name: 'palisade repository.update, SQL expression (balance + n)',
      fn: async () => {
        const r = await repo.update({ id: randomId(rows) }, fences.next() as Fence, {
          balance: dsql`${table.balance} + ${value()}`,
        });
        if (r.status !== 'applied' && r.status !== 'stale') throw new Error(`repository update: ${r.status}`);
      },
    },
  ];
}

const FLOOR = 0;
const FENCED = 1;
const AGAIN = 2;
const RETURNING = 3;
const CTE = 4;
const REPO = 8;
const REPO_STATUS = 9;

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
    const fenced = m[FENCED] as Measured;
    const t = report.table('1. Fenced write path', `${label}, random row of ${ROWS.toLocaleString('en-US')}`, [
      'case',
      'ops/s',
      'p50 ms',
      'p99 ms',
      '× raw fenced',
      '× raw fenced, min–max of rounds',
      '× raw plain',
      'client CPU µs/op',
    ]);
    for (const r of m) {
      t.rows.push([
        ...comparedCells(r, fenced),
        ratio(pairedRatio(r, m[FLOOR] as Measured).median),
        r.cpuUsPerCall.toFixed(0),
      ]);
    }
    t.notes.push(
      'Ratios are medians of per-round ratios: round i of one case ran beside round i of the other (the rounds rotate the order of the cases).',
      'All cases on one postgres.js client (24 connections) with synchronous_commit = off: the WAL flush is the same for every case and would swamp the differences on a shared disk.',
      "On the success path the repository sends only the plain fenced UPDATE (RETURNING * for the row; nothing back for returning: 'status', whose row count says it applied); the refusal statement follows only when that wrote nothing, and reports stale / duplicate / missing (or applies, if the row became writable in between). \"Unnamed statement\" is what drizzle's postgres-js driver sends when a query has no name (postgres.js then parses and describes it in an extra round trip on every call) — how the repository ran before its driver module named its cached statements.",
    );
    printTable(t);
    // Like with like (the same rows back), and the comparison as it stands (the row back
    // against none): the difference between the two is what RETURNING * costs the server and the client.
    for (const [index, what, against, reference] of [
      [REPO_STATUS, "repository.update returning 'status'", FENCED, 'raw fenced UPDATE'],
      [REPO, 'repository.update (the row back)', RETURNING, 'raw fenced UPDATE … RETURNING *'],
      [REPO, 'repository.update (the row back)', FENCED, 'raw fenced UPDATE (no row back)'],
    ] as const) {
      const r = pairedRatio(m[index] as Measured, m[against] as Measured).median;
      report.goal({
        section: '1',
        goal: `${what} ≥ 0.95× ${reference} (${label})`,
        measured: ratio(r),
        met: r >= 0.95,
      });
    }
    const control = pairedRatio(m[AGAIN] as Measured, fenced);
    t.notes.push(
      `A/A control: the fenced UPDATE measured twice came out at ${ratio(control.median)} of itself (rounds ${ratio(control.min)}–${ratio(control.max)}); a ratio closer to a goal than that is within noise.`,
    );
    const fenceCost = 1 - pairedRatio(fenced, m[FLOOR] as Measured).median;
    report.goal({
      section: '1',
      goal: `fence condition costs ≤ 5% over the plain UPDATE (${label})`,
      measured: `${(fenceCost * 100).toFixed(1)}%`,
      met: fenceCost <= 0.05,
    });
    const whyCost = 1 - pairedRatio(m[CTE] as Measured, fenced).median;
    const returningCost = 1 - pairedRatio(m[RETURNING] as Measured, fenced).median;
    t.notes.push(
      `The refusal statement costs ${(whyCost * 100).toFixed(1)}% over the fenced UPDATE when sent alone (RETURNING * alone: ${(returningCost * 100).toFixed(1)}%); it is sent only when the plain write did not apply.`,
    );
    await withFullCollections(ctx, cases, concurrency, label, results);
  }
  report.raw.writePath = results;
}

/**
 * A diagnostic, no goal: the raw fenced UPDATE and the repository's update
 * again, with a full collection between rounds (how runs before 2026-12-03
 * decided). A full collection makes V8 discard optimized code that embedded
 * objects that died, postgres.js's and the repository's alike, so each
 * round compiles them again; the repository, with more functions on the
 * path, pays more (see the findings).
 */
async function withFullCollections(
  ctx: BenchContext,
  all: readonly Case[],
  concurrency: number,
  label: string,
  results: Record<string, Measured[]>,
): Promise<void> {
  const cases = [FENCED, REPO_STATUS, RETURNING, REPO].map((i) => all[i] as Case);
  const m = await compare(cases, {
    concurrency,
    rounds: ctx.scale.rounds,
    timeMs: ctx.scale.timeMs,
    collection: 'full',
  });
  results[`${label}, full collection between rounds`] = m;
  const t = ctx.report.table(
    '1. Fenced write path',
    `${label}, the same cases with a full collection between rounds (diagnostic)`,
    ['case', 'ops/s', 'p50 ms', 'p99 ms', '× raw fenced', '× raw fenced, min–max of rounds', 'client CPU µs/op'],
  );
  for (const r of m) t.rows.push([...comparedCells(r, m[0] as Measured), r.cpuUsPerCall.toFixed(0)]);
  const status = pairedRatio(m[1] as Measured, m[0] as Measured).median;
  const row = pairedRatio(m[3] as Measured, m[2] as Measured).median;
  t.notes.push(
    `No goal is decided here. With a full collection between rounds: returning 'status' ${ratio(status)} of the raw fenced UPDATE, the row back ${ratio(row)} of the raw UPDATE … RETURNING *.`,
  );
  printTable(t);
}
