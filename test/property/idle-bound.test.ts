/**
 * The idle bound of lock-scoped work (README, "Known limits"), searched on a
 * REAL Postgres: random nestings of transactions — the caller's own, fenced
 * transactions of either lease, row-scoped `modify`s, savepoints that commit
 * or roll back — with lock-scoped writes of every kind (through a repository
 * on the database, which joins the transaction, or on the transaction),
 * `claimLockRegister` and checks in between. Four holders: `S`, whose TTL
 * left is ~5 s, and `L`, whose bound is the 60 s cap; `O`, ~5 s left, of a
 * lock a higher fence claimed first, so each of its claims is refused; and
 * `R`, of such a lock too, whose TTL ran out while its signal has not aborted
 * (a process resumed after a pause).
 *
 * The model: a claim holds its lock's register row until the transaction
 * ends, unless the savepoint it was made in rolls back — a refused one too
 * (one that waited for a concurrent raise keeps its share of the row). At
 * every check, with a claim of `S` or `O` standing the transaction's
 * `idle_in_transaction_session_timeout` is set and at most 5 s; with only
 * claims of `L`, set and at most 60 s. (A paused holder then keeps the next
 * holder out for no longer than that.) Every write of `O` and `R` is
 * refused, and `R` claims nothing: it opens and bounds no transaction, so
 * its session goes on.
 */
import { randomBytes } from 'node:crypto';
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const table = pgTable('idle_rows', { id: integer('id').primaryKey(), v: text('v'), ...fenceColumns() });
const ROWS = 4;
const S_TTL_MS = 5_000;
const CAP_MS = 60_000;
const HIGHER = toFence(5n);

type Who = 'S' | 'L' | 'O' | 'R';
type Leased = 'S' | 'L';
type Write = 'update' | 'delete' | 'upsert' | 'modify' | 'updateWhere';
type Step =
  | { readonly t: 'write'; readonly who: Who; readonly write: Write; readonly via: 'db' | 'tx'; readonly row: number }
  | { readonly t: 'claim'; readonly who: Who }
  | { readonly t: 'check' }
  | { readonly t: 'savepoint'; readonly body: readonly Step[]; readonly rollback: boolean }
  | { readonly t: 'fenced'; readonly who: Leased; readonly body: readonly Step[] }
  | { readonly t: 'rowModify'; readonly row: number; readonly body: readonly Step[] };
interface Program {
  /** The registers claimed beforehand (as a grant that claims does): a rolled-back claim leaves them. */
  readonly registered: boolean;
  readonly root: 'transaction' | 'fenced S' | 'fenced L' | 'rowModify';
  readonly body: readonly Step[];
}

// Weighted toward what reaches the rare shapes: S (the tighter bound), update and delete (the path that
// claims in its own statement), writes that join, savepoints that roll back.
const who = fc.constantFrom<Who>('S', 'S', 'L', 'O', 'R');
const leased = fc.constantFrom<Leased>('S', 'S', 'L');
const row = fc.integer({ min: 1, max: ROWS });
const { step } = fc.letrec<{ step: Step; body: Step[] }>((tie) => ({
  step: fc.oneof(
    { depthSize: 'small', withCrossShrink: true },
    {
      weight: 4,
      arbitrary: fc.record({
        t: fc.constant('write' as const),
        who,
        write: fc.constantFrom<Write>('update', 'update', 'update', 'delete', 'upsert', 'modify', 'updateWhere'),
        via: fc.constantFrom<'db' | 'tx'>('db', 'db', 'tx'),
        row,
      }),
    },
    { weight: 1, arbitrary: fc.record({ t: fc.constant('claim' as const), who }) },
    { weight: 1, arbitrary: fc.record({ t: fc.constant('check' as const) }) },
    {
      weight: 2,
      arbitrary: fc.record({ t: fc.constant('savepoint' as const), body: tie('body'), rollback: fc.boolean() }),
    },
    { weight: 1, arbitrary: fc.record({ t: fc.constant('fenced' as const), who: leased, body: tie('body') }) },
    { weight: 1, arbitrary: fc.record({ t: fc.constant('rowModify' as const), row, body: tie('body') }) },
  ),
  body: fc.array(tie('step'), { maxLength: 4 }) as fc.Arbitrary<Step[]>,
}));
const programArb: fc.Arbitrary<Program> = fc.record({
  registered: fc.constantFrom(true, true, false),
  root: fc.constantFrom<Program['root']>('transaction', 'fenced S', 'fenced L', 'rowModify'),
  body: fc.array(step, { minLength: 1, maxLength: 6 }),
});

class RollBack extends Error {}

let test_: TestDatabase | undefined;
let db: Database;

describe.runIf(needs('DATABASE_URL'))('the idle bound of lock-scoped work', () => {
  beforeAll(async () => {
    test_ = await postgresDatabase();
    db = test_.db;
    await migrate(db);
    await execute(
      db,
      sql`create table idle_rows (id integer primary key, v text, last_fence bigint not null default 0, deleted_at timestamptz)`,
    );
  }, 120_000);
  afterAll(async () => {
    await test_?.close();
  });

  test.prop([programArb], propertyParams({ numRuns: propertyRuns(400) }))(
    'every transaction a claim stands in is bounded by its lease, in any nesting, after any rollback',
    async (program) => {
      await execute(db, sql`truncate idle_rows`);
      await execute(db, sql`insert into idle_rows (id, v) select g, 'initial' from generate_series(1, ${ROWS}) g`);
      const lock = (name: string) =>
        Object.freeze({ kind: 'model', source: `idle-${randomBytes(5).toString('hex')}`, namespace: 'p', name });
      const signal = new AbortController().signal;
      const fence = toFence(1n);
      const holders = {
        S: { fence, lock: lock('S'), signal, expiresAt: performance.now() + S_TTL_MS },
        L: { fence, lock: lock('L'), signal, expiresAt: performance.now() + 10 * CAP_MS },
        O: { fence, lock: lock('O'), signal, expiresAt: performance.now() + S_TTL_MS },
        R: { fence, lock: lock('R'), signal, expiresAt: performance.now() - 1 },
      };
      // A higher fence claimed O's and R's locks first.
      for (const h of [holders.O, holders.R]) await claimLockRegister(db, { fence: HIGHER, lock: h.lock, signal });
      const repo = fencedRepository(db, table, { sameFence: 'allow' });
      if (program.registered) for (const h of [holders.S, holders.L]) await claimLockRegister(db, h);
      // The claims standing, one set per open transaction or savepoint (innermost last).
      const levels: Set<Who>[] = [];
      const standing = () => new Set(levels.flatMap((l) => [...l]));

      const check = async (tx: Database) => {
        const claims = standing();
        if (claims.size === 0) return;
        const [r] = await execute(
          tx,
          sql`select extract(epoch from current_setting('idle_in_transaction_session_timeout')::interval) * 1000 as ms`,
        );
        const ms = Number(r?.ms);
        const most = claims.has('S') || claims.has('O') ? S_TTL_MS : CAP_MS;
        expect(ms > 0 && ms <= most, `idle bound ${ms} ms with claims of ${[...claims].join(', ')} standing`).toBe(
          true,
        );
      };
      const claimed = (w: Who) => (w === 'R' ? undefined : levels.at(-1)?.add(w));
      const refused = (w: Who) => w === 'O' || w === 'R';
      // Open fenced transactions: a refused write inside one makes it refused as a whole (README, "Fenced
      // transactions"), so O and R write only outside them.
      let fenced = 0;
      // A level of its own for `body`, merged into the one around it unless it rolls back.
      const nested = async <R>(run: () => Promise<R>): Promise<R> => {
        levels.push(new Set());
        try {
          const value = await run();
          const done = levels.pop() as Set<Who>;
          for (const w of done) claimed(w);
          return value;
        } catch (err) {
          levels.pop();
          throw err;
        }
      };

      // `joined`: inside a transaction palisade opened on the database (a fenced transaction, a modify), which
      // a repository on the database joins. In your own transaction alone it would not: that would be
      // another connection, waiting for this one's row locks. So there a write `via: 'db'` goes through the
      // transaction, and a fenced transaction or a modify opens on it (a savepoint).
      const exec = async (tx: Database, steps: readonly Step[], joined: boolean): Promise<void> => {
        for (const s of steps) {
          if (s.t === 'check') await check(tx);
          else if (s.t === 'claim') {
            const result = await claimLockRegister(tx, holders[s.who]);
            if (refused(s.who)) expect(result).toEqual({ status: 'stale', currentFence: HIGHER });
            claimed(s.who);
          } else if (s.t === 'write') {
            if (refused(s.who) && fenced > 0) continue;
            const leased = (s.via === 'db' && joined ? repo : fencedRepository(tx, table, { sameFence: 'allow' })).with(
              holders[s.who],
            );
            const v = `${s.who} ${s.write}`;
            let result: unknown;
            if (s.write === 'update') result = await leased.update({ id: s.row }, { v });
            else if (s.write === 'delete') result = await leased.delete({ id: s.row });
            else if (s.write === 'upsert') result = await leased.upsert({ id: s.row, v });
            else if (s.write === 'modify') result = await leased.modify({ id: s.row }, () => ({ v }));
            else result = await leased.updateWhere(sql`${table.id} = ${s.row}`, { v });
            if (refused(s.who)) {
              expect(result).toMatchObject(
                s.write === 'updateWhere' ? { applied: 0 } : { status: 'stale', currentFence: HIGHER },
              );
            }
            claimed(s.who);
          } else if (s.t === 'savepoint') {
            await nested(() =>
              tx.transaction(async (sp) => {
                await exec(sp as unknown as Database, s.body, joined);
                if (s.rollback) throw new RollBack();
              }),
            ).catch((err: unknown) => {
              if (!(err instanceof RollBack)) throw err;
            });
          } else if (s.t === 'fenced') {
            const result = await nested(() =>
              fencedTransaction(joined ? db : tx, holders[s.who], async (ftx) => {
                claimed(s.who);
                fenced++;
                try {
                  await exec(ftx, s.body, joined);
                } finally {
                  fenced--;
                }
              }),
            );
            expect(result.status).toBe('applied');
          } else {
            await nested(() =>
              (joined ? repo : fencedRepository(tx, table, { sameFence: 'allow' })).modify(
                { id: s.row },
                fence,
                async (_row, mtx) => {
                  await exec(mtx, s.body, joined);
                  return { v: 'row-scoped modify' };
                },
              ),
            );
          }
          await check(tx);
        }
      };

      if (program.root === 'transaction') {
        await nested(() => db.transaction((tx) => exec(tx as unknown as Database, program.body, false)));
      } else if (program.root === 'rowModify') {
        await nested(() =>
          repo.modify({ id: 1 }, fence, async (_row, tx) => {
            await exec(tx, program.body, true);
            return { v: 'row-scoped modify' };
          }),
        );
      } else {
        const w: Who = program.root === 'fenced S' ? 'S' : 'L';
        const result = await nested(() =>
          fencedTransaction(db, holders[w], async (tx) => {
            claimed(w);
            fenced++;
            await exec(tx, program.body, true);
          }),
        );
        expect(result.status).toBe('applied');
      }
    },
    propertyTimeout(300_000),
  );
});
