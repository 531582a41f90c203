/**
 * Section 9 — lock scope (README, "Two scopes of fencing"): what claiming
 * the lock's register in the write's own statement costs over a row-scoped
 * write, with one lock and with many, serial and 16 clients; a fenced
 * transaction of N writes against a plain transaction of the same writes;
 * and a register table of 1,000,000 names against one of 10.
 *
 * Each case holds one fence, as a lease does, and writes random rows of
 * 10,000 with it (`sameFence: 'allow'`), so every write applies and the
 * register is claimed at the same fence (shared) on every call but the first.
 * A holder's lock identity is frozen, as a lease's is: after its first
 * write, a write shares the register by its key alone. One case writes with
 * a new identity object each time (as a fresh lease's first write), which
 * takes the full claim.
 */
import { drizzle } from 'drizzle-orm/postgres-js';
import type { Database } from '../../src/driver.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import type { LockIdentity } from '../../src/fencing/lock-identity.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { BenchContext } from '../lib/context.js';
import { type Case, compare, type Measured, pairedRatio } from '../lib/measure.js';
import { comparedCells, printTable, ratio } from '../lib/report.js';
import { createAccounts, makeAccounts, randomId } from '../lib/tables.js';

const ROWS = 10_000;
const MANY_LOCKS = 1_000;
const TX_WRITES = 10;

const lockOf = (source: string, name: string): LockIdentity =>
  Object.freeze({ kind: 'bench', source, namespace: 'bench', name });

export async function lockScope(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const name = 'bench_scope';
  await createAccounts(ctx.pg.sql, name, ROWS);
  const table = makeAccounts(name);
  const sql = ctx.pg.client(24, { synchronous_commit: 'off' });
  const db = drizzle(sql) as unknown as Database;
  await migrate(db);
  const repo = fencedRepository(db, table, { sameFence: 'allow' });
  const fence = toFence(1_000_000n) as Fence;
  const signal = new AbortController().signal;
  const holder = (lock: LockIdentity) => ({ fence, signal, lock });
  const value = () => Math.floor(Math.random() * 1_000_000);
  const applied = (r: { status: string }) => {
    if (r.status !== 'applied') throw new Error(`lock-scope bench: ${r.status}`);
  };

  // 1,000,000 registered names (of another source) beside the ones measured: the register table's size.
  const registered = scale.name === 'full' ? 1_000_000 : 100_000;
  await sql.unsafe(
    `insert into palisade.lock_registers (kind, source, namespace, name, fence)
     select 'bench', 'filler', 'bench', 'n' || g, 1 from generate_series(1, ${registered}) g`,
  );
  await sql.unsafe(
    `insert into palisade.lock_registers (kind, source, namespace, name, fence)
     select 'bench', 'big', 'bench', 'n' || g, ${fence} from generate_series(1, ${registered}) g`,
  );
  await sql.unsafe('vacuum analyze palisade.lock_registers');
  const one = holder(lockOf('one', 'L'));
  const many = Array.from({ length: MANY_LOCKS }, (_, i) => holder(lockOf('many', `L${i}`)));
  const ten = Array.from({ length: 10 }, (_, i) => holder(lockOf('ten', `n${i + 1}`)));
  const big = Array.from({ length: 1_000 }, () => holder(lockOf('big', `n${randomId(registered)}`)));
  const pick = <T>(xs: readonly T[]) => xs[Math.floor(Math.random() * xs.length)] as T;

  const writeCases: Case[] = [
    {
      name: 'row-scoped repository.update (bare fence)',
      fn: async () =>
        applied(await repo.update({ id: randomId(ROWS) }, fence, { balance: value() }, { returning: 'status' })),
    },
    {
      name: 'lock-scoped with(lease).update, one lock',
      fn: async () =>
        applied(await repo.with(one).update({ id: randomId(ROWS) }, { balance: value() }, { returning: 'status' })),
    },
    {
      name: 'lock-scoped, one lock, the full claim (a fresh lease identity per write)',
      fn: async () =>
        applied(
          await repo
            .with({ ...one, lock: { ...one.lock } })
            .update({ id: randomId(ROWS) }, { balance: value() }, { returning: 'status' }),
        ),
    },
    {
      name: `lock-scoped, one of ${MANY_LOCKS.toLocaleString('en-US')} locks`,
      fn: async () =>
        applied(
          await repo.with(pick(many)).update({ id: randomId(ROWS) }, { balance: value() }, { returning: 'status' }),
        ),
    },
    {
      name: 'lock-scoped, one of 10 registered names',
      fn: async () =>
        applied(
          await repo.with(pick(ten)).update({ id: randomId(ROWS) }, { balance: value() }, { returning: 'status' }),
        ),
    },
    {
      name: `lock-scoped, one of ${registered.toLocaleString('en-US')} registered names`,
      fn: async () =>
        applied(
          await repo.with(pick(big)).update({ id: randomId(ROWS) }, { balance: value() }, { returning: 'status' }),
        ),
    },
    {
      // The first case again: its ratio to the first shows how far noise alone moves a ratio.
      name: 'row-scoped repository.update, again (A/A control)',
      fn: async () =>
        applied(await repo.update({ id: randomId(ROWS) }, fence, { balance: value() }, { returning: 'status' })),
    },
  ];
  // A transaction's rows in ascending order: 16 clients writing random rows in random order deadlock.
  const txRows = () => Array.from({ length: TX_WRITES }, () => randomId(ROWS)).sort((a, b) => a - b);
  const txCases: Case[] = [
    {
      name: `plain transaction of ${TX_WRITES} row-scoped writes`,
      fn: () =>
        db.transaction(async (tx) => {
          const inTx = fencedRepository(tx as unknown as Database, table, { sameFence: 'allow' });
          for (const id of txRows()) await inTx.update({ id }, fence, { balance: value() });
        }),
    },
    {
      name: `fencedTransaction of the same ${TX_WRITES} writes`,
      fn: async () => {
        const r = await fencedTransaction(db, one, async () => {
          for (const id of txRows()) await repo.update({ id }, fence, { balance: value() });
        });
        applied(r);
      },
    },
  ];

  const raw: Record<string, Measured[]> = {};
  for (const concurrency of [1, 16]) {
    const label = concurrency === 1 ? 'serial' : `${concurrency} concurrent`;
    for (const [title, cases] of [
      ['writes', writeCases],
      ['transactions', txCases],
    ] as const) {
      const m = await compare(cases, { concurrency, rounds: scale.rounds, timeMs: scale.timeMs });
      raw[`${title} ${label}`] = m;
      const base = m[0] as Measured;
      const t = report.table('9. Lock scope', `${title}, ${label}`, [
        'case',
        'ops/s',
        'p50 ms',
        'p99 ms',
        '× first row',
        '× first row, min–max of rounds',
      ]);
      for (const r of m) t.rows.push(comparedCells(r, base));
      t.notes.push('Ratios are medians of per-round ratios (round i of one case ran beside round i of the other).');
      printTable(t);
      if (title === 'writes') {
        for (const [index, what] of [
          [1, 'lock-scoped write, one lock'],
          [3, `lock-scoped write, ${MANY_LOCKS} locks`],
        ] as const) {
          const r = pairedRatio(m[index] as Measured, base).median;
          report.goal({
            section: '9',
            goal: `${what} ≥ 0.9× row-scoped (${label})`,
            measured: ratio(r),
            met: r >= 0.9,
          });
        }
        const size = pairedRatio(m[5] as Measured, m[4] as Measured).median;
        report.goal({
          section: '9',
          goal: `${registered.toLocaleString('en-US')} registered names ≥ 0.9× 10 names per write (${label})`,
          measured: ratio(size),
          met: size >= 0.9,
        });
      } else {
        const r = pairedRatio(m[1] as Measured, base).median;
        // One statement more than N + 2 (BEGIN, N writes, COMMIT): the expected ratio is (N + 2) / (N + 3).
        const expected = (TX_WRITES + 2) / (TX_WRITES + 3);
        report.goal({
          section: '9',
          goal: `fencedTransaction of ${TX_WRITES} writes costs one statement more, not ${TX_WRITES}: ≥ 0.9 × ${expected.toFixed(2)}× (${label})`,
          measured: ratio(r),
          met: r >= 0.9 * expected,
        });
      }
    }
  }
  report.raw.lockScope = raw;
}
