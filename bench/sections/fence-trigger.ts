/**
 * Section 10 — what the fence trigger (README, "Adding fencing to an
 * existing table") costs a write: `repository.update` on three tables of
 * the same rows, one without the trigger, one with it, and one with it but
 * for its check after the update (its `AFTER UPDATE` trigger, dropped
 * there: not a configuration palisade offers, only that check's share).
 *
 * Each write has a fresh, higher fence on a random row of 10,000; at 16
 * clients two writes of one row may arrive out of fence order, and the later
 * one is refused (`stale`) — the same on every table. No goal: a price list.
 */
import { drizzle } from 'drizzle-orm/postgres-js';
import type { Database } from '../../src/driver.js';
import type { Fence } from '../../src/fencing/fence.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { AFTER_TRIGGER_NAME, installFenceTrigger } from '../../src/schema/fence-trigger.js';
import type { BenchContext } from '../lib/context.js';
import { type Case, compare, type Measured } from '../lib/measure.js';
import { comparedCells, printTable } from '../lib/report.js';
import { createAccounts, FenceCounter, makeAccounts, randomId } from '../lib/tables.js';

const ROWS = 10_000;

const TABLES = [
  { name: 'bench_trigger_none', label: 'repository.update, no fence trigger' },
  { name: 'bench_trigger_full', label: 'repository.update, fence trigger installed' },
  { name: 'bench_trigger_no_after', label: 'the same, without its check after the update (diagnostic)' },
] as const;

export async function fenceTrigger(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const admin = { execute: (statement: string) => ctx.pg.sql.unsafe(statement) };
  for (const { name } of TABLES) await createAccounts(ctx.pg.sql, name, ROWS);
  for (const { name } of TABLES.slice(1)) await installFenceTrigger(admin, makeAccounts(name));
  await ctx.pg.sql.unsafe(`drop trigger ${AFTER_TRIGGER_NAME} on ${TABLES[2].name}`);
  const sql = ctx.pg.client(24, { synchronous_commit: 'off' });
  const db = drizzle(sql) as unknown as Database;
  const fences = new FenceCounter(1_000_000_000n);
  const cases: Case[] = TABLES.map(({ name, label }) => {
    const repo = fencedRepository(db, makeAccounts(name));
    return {
      name: label,
      fn: async () => {
        const r = await repo.update(
          { id: randomId(ROWS) },
          fences.next() as Fence,
          { balance: 1 },
          {
            returning: 'status',
          },
        );
        if (r.status !== 'applied' && r.status !== 'stale') throw new Error(`fence-trigger bench: ${r.status}`);
      },
    };
  });
  const results: Record<string, Measured[]> = {};
  for (const concurrency of [1, 16]) {
    const label = concurrency === 1 ? 'serial' : `${concurrency} concurrent`;
    const m = await compare(cases, { concurrency, rounds: scale.rounds, timeMs: scale.timeMs });
    results[label] = m;
    const t = report.table('10. Fence trigger', `${label}, random row of ${ROWS.toLocaleString('en-US')}`, [
      'case',
      'ops/s',
      'p50 ms',
      'p99 ms',
      '× no trigger',
      '× no trigger, min–max of rounds',
      'client CPU µs/op',
    ]);
    for (const r of m) t.rows.push([...comparedCells(r, m[0] as Measured), r.cpuUsPerCall.toFixed(0)]);
    t.notes.push("Ratios are medians of per-round ratios. Every case returns the status only (returning: 'status').");
    printTable(t);
  }
  report.raw.fenceTrigger = results;
}
