/**
 * Interleavings of several lock holders on a REAL Postgres, explored with
 * `fc.scheduler()`: the *start* of every database call, every lock grant,
 * release and lease expiry is a scheduled task, so fast-check chooses the
 * order (and, where a generated flag says so, lets two calls overlap inside
 * Postgres). Grants come from an in-process lock model with a fence
 * counter: a waiter is granted the lock when it is free or, as when a TTL
 * runs out, by expiring the current holder — who does not notice and goes on
 * writing with its old fence. That is the worst case the repository must
 * handle; the lock itself is only an efficiency measure.
 *
 * A trigger appends every change of the row to an audit table inside the
 * writing statement, after the row lock is taken, so audit ids follow commit
 * order. The serial model then says what may have been accepted:
 *
 * - fences of applied writes strictly increase in commit order (no write
 *   applied after a higher or equal fence had);
 * - exactly the writes reported `applied` are in the audit; every `stale`
 *   names an applied fence above its own; every `duplicate` repeats an
 *   applied fence; the highest fence that tried to write did write;
 * - `modify` and SQL-expression increments never lose an update (each adds
 *   exactly 1 to the committed value) and `modify` calls its function
 *   exactly when its write applies;
 * - the audit's values chain up to the row's final value.
 *
 * A second property shows the contrast: a plain get-then-update with a valid
 * fence CAN lose an increment, and fast-check finds such an interleaving.
 */
import { randomBytes } from 'node:crypto';
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import { type Database, execute, int8 } from '../../src/driver.js';
import { type Fence, toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import type { WriteResult } from '../../src/repo/result.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const counters = pgTable('palisade_prop_counters', {
  id: text('id').primaryKey(),
  n: integer('n').notNull().default(0),
  v: text('v'),
  ...fenceColumns(),
});
type CounterRow = typeof counters.$inferSelect;

type OpKind = 'write' | 'upsert' | 'modify' | 'expr' | 'naive' | 'read' | 'expire';
interface Session {
  readonly ops: readonly OpKind[];
  /** Release at the end of the session (otherwise the lease is just abandoned, to expire). */
  readonly release: boolean;
}
interface Scenario {
  readonly holders: readonly (readonly Session[])[];
  /** Per scheduling decision: true lets the next call start while others are still running in Postgres. */
  readonly overlap: readonly boolean[];
}

const sessionArb = (ops: fc.Arbitrary<OpKind>) =>
  fc.record({ ops: fc.array(ops, { minLength: 1, maxLength: 3 }), release: fc.boolean() });

const allOps = fc.constantFrom<OpKind>('write', 'upsert', 'modify', 'expr', 'naive', 'read', 'expire');
const safeOps = fc.constantFrom<OpKind>('write', 'upsert', 'modify', 'expr', 'read', 'expire');

function scenarioArb(ops: fc.Arbitrary<OpKind>, maxHolders = 3): fc.Arbitrary<Scenario> {
  return fc.record({
    holders: fc.array(fc.array(sessionArb(ops), { minLength: 1, maxLength: 2 }), {
      minLength: 2,
      maxLength: maxHolders,
    }),
    overlap: fc.array(fc.boolean(), { maxLength: 24 }),
  });
}

/** The lock, modelled in-process: one fence counter, one holder at a time, expiry on demand. */
class LockModel {
  #next = 0n;
  #held: { holder: number; fence: Fence } | null = null;
  readonly issued: Fence[] = [];

  /** A waiter gets the lock when it is free, or when the current lease runs out (its holder is not told). */
  grant(holder: number): Fence {
    this.#next += 1n;
    const fence = toFence(this.#next);
    this.#held = { holder, fence };
    this.issued.push(fence);
    return fence;
  }
  expire(fence: Fence): void {
    if (this.#held?.fence === fence) this.#held = null;
  }
  release(fence: Fence): 'released' | 'lost' {
    if (this.#held?.fence !== fence) return 'lost';
    this.#held = null;
    return 'released';
  }
}

interface WriteAttempt {
  readonly tag: string;
  readonly kind: OpKind;
  readonly fence: Fence;
  readonly result: WriteResult<CounterRow> | { status: 'error'; error: unknown };
  /** naive: the value read before writing; modify: whether its function ran. */
  readonly read?: number;
  readonly fnCalled?: boolean;
}

interface AuditRow {
  readonly fence: bigint;
  readonly oldN: number;
  readonly newN: number;
  readonly v: string;
}

interface Outcome {
  readonly attempts: WriteAttempt[];
  readonly reads: (CounterRow | undefined)[];
  readonly audit: AuditRow[];
  readonly final: { n: number; fence: bigint };
  readonly issued: Fence[];
}

/** Rows are created in batches ahead of the runs (one round trip per batch, not per run). */
const spareRows: string[] = [];
async function freshRow(db: Database): Promise<string> {
  if (spareRows.length === 0) {
    const ids = Array.from({ length: 250 }, () => `r${randomBytes(6).toString('hex')}`);
    await db.insert(counters).values(ids.map((id) => ({ id })));
    spareRows.push(...ids);
  }
  return spareRows.pop() as string;
}

/**
 * Runs `scenario` under scheduler `s` against a fresh row of `db`. Every
 * holder parks before each step; unless the step's overlap flag is set,
 * the scheduler picks the next step only once every holder has parked or
 * finished, so the order of calls (and so a replay) is the scheduler's.
 */
async function play(s: fc.Scheduler, db: Database, scenario: Scenario): Promise<Outcome> {
  const key = await freshRow(db);
  const repo = fencedRepository(db, counters);
  const lock = new LockModel();
  const attempts: WriteAttempt[] = [];
  const reads: (CounterRow | undefined)[] = [];

  const parked = scenario.holders.map(() => false);
  const done = scenario.holders.map(() => false);
  let wake: (() => void) | undefined;
  const changed = () => {
    wake?.();
    wake = undefined;
  };
  const settled = () => parked.every((p, i) => p || done[i]);
  let decision = 0;
  const act = async (pick: () => Promise<void>) => {
    const overlap = scenario.overlap[decision++] ?? false;
    // Bounded: a call that never returns would fail the test by its timeout, never loop forever.
    for (let i = 0; !overlap && !settled() && i < 100_000; i++) {
      await new Promise<void>((resolve) => {
        wake = resolve;
      });
    }
    await pick();
  };

  async function step<T>(holder: number, label: string, fn: () => Promise<T> | T): Promise<T> {
    parked[holder] = true;
    changed();
    await s.schedule(Promise.resolve(label), label);
    parked[holder] = false;
    try {
      return await fn();
    } finally {
      changed();
    }
  }

  async function holder(h: number, sessions: readonly Session[]): Promise<void> {
    for (const [si, session] of sessions.entries()) {
      const fence = await step(h, `h${h} acquire`, () => lock.grant(h));
      for (const [oi, kind] of session.ops.entries()) {
        const tag = `${kind}:h${h}:${fence}:${si}.${oi}`;
        const label = `h${h} f${fence} ${kind}`;
        const attempt = async (
          fn: () => Promise<WriteResult<CounterRow>>,
          extra: Partial<WriteAttempt> = {},
        ): Promise<void> => {
          let result: WriteAttempt['result'];
          try {
            result = await fn();
          } catch (error) {
            result = { status: 'error', error };
          }
          attempts.push({ tag, kind, fence, result, ...extra });
        };
        switch (kind) {
          case 'expire':
            await step(h, label, () => lock.expire(fence));
            break;
          case 'read':
            reads.push(await step(h, label, () => repo.get({ id: key })));
            break;
          case 'write':
            await step(h, label, () => attempt(() => repo.update({ id: key }, fence, { v: tag })));
            break;
          case 'upsert':
            await step(h, label, () => attempt(() => repo.upsert({ id: key, v: tag }, fence)));
            break;
          case 'expr':
            await step(h, label, () =>
              attempt(() => repo.update({ id: key }, fence, { n: sql`${counters.n} + 1`, v: tag })),
            );
            break;
          case 'modify': {
            let fnCalled = false;
            await step(h, label, () =>
              attempt(
                () =>
                  repo.modify({ id: key }, fence, (row) => {
                    fnCalled = true;
                    return { n: row.n + 1, v: tag };
                  }),
                {
                  get fnCalled() {
                    return fnCalled;
                  },
                },
              ),
            );
            break;
          }
          case 'naive': {
            // Read, then (a separately scheduled call) write read + 1 with a valid fence.
            const row = await step(h, `${label} get`, () => repo.get({ id: key }));
            const read = row?.n ?? 0;
            await step(h, `${label} update`, () =>
              attempt(() => repo.update({ id: key }, fence, { n: read + 1, v: tag }), { read }),
            );
            break;
          }
        }
      }
      if (session.release) await step(h, `h${h} release`, () => lock.release(fence));
    }
  }

  const all = Promise.all(
    scenario.holders.map((sessions, h) =>
      holder(h, sessions).finally(() => {
        done[h] = true;
        changed();
      }),
    ),
  );
  await s.waitFor(all, act);

  // The row and its audit trail in one round trip (the row's columns repeat on each audit line).
  const rows = await execute(
    db,
    sql`select c.n as final_n, c.last_fence as final_fence, a.fence, a.old_n, a.new_n, a.v
        from palisade_prop_counters c left join palisade_prop_audit a on a.key = c.id
        where c.id = ${key} order by a.id`,
  );
  const first = rows[0];
  return {
    attempts,
    reads,
    audit: rows
      .filter((r) => r.v !== null)
      .map((r) => ({ fence: int8(r.fence) ?? 0n, oldN: Number(r.old_n), newN: Number(r.new_n), v: String(r.v) })),
    final: { n: first ? Number(first.final_n) : -1, fence: int8(first?.final_fence) ?? -1n },
    issued: lock.issued,
  };
}

/** One line per write attempt and audit row, for a failure report. */
function describeOutcome(o: Outcome): string {
  const results = o.attempts.map((a) => {
    const r = a.result;
    const detail =
      r.status === 'stale' ? ` (current f${r.currentFence})` : r.status === 'error' ? ` (${String(r.error)})` : '';
    return `  ${a.tag} → ${r.status}${detail}${a.read === undefined ? '' : ` read n=${a.read}`}${a.fnCalled === undefined ? '' : ` fn ${a.fnCalled ? 'called' : 'not called'}`}`;
  });
  const audit = o.audit.map((a) => `  f${a.fence}: n ${a.oldN} → ${a.newN} by ${a.v}`);
  return ['attempts:', ...results, 'audit (commit order):', ...audit, `final: n=${o.final.n} f${o.final.fence}`].join(
    '\n',
  );
}

const kindOf = (tag: string) => tag.split(':')[0] as OpKind;

/** The serial model: what the repository may have accepted, given the audit's commit order. */
function checkOutcome(o: Outcome): void {
  const applied = o.attempts.filter((a) => a.result.status === 'applied');
  const auditFences = o.audit.map((a) => a.fence);

  // Fences issued strictly increase (the lock model's own sanity).
  for (let i = 1; i < o.issued.length; i++) expect(o.issued[i]).toBeGreaterThan(o.issued[i - 1] as bigint);

  // No write applied after a higher or equal fence had applied.
  for (let i = 1; i < auditFences.length; i++) {
    expect(auditFences[i], `audit #${i}: fence ${auditFences[i]} after ${auditFences[i - 1]}`).toBeGreaterThan(
      auditFences[i - 1] as bigint,
    );
  }

  // Exactly the writes reported applied are in the audit.
  expect(o.audit.map((a) => a.v).sort()).toEqual(applied.map((a) => a.tag).sort());

  for (const a of o.attempts) {
    const r = a.result;
    if (r.status === 'error') throw new Error(`${a.tag}: unexpected error ${String(r.error)}`, { cause: r.error });
    if (r.status === 'missing') throw new Error(`${a.tag}: the row exists, yet the write reported missing`);
    if (r.status === 'stale') {
      expect(r.currentFence, `${a.tag}: stale names a fence above its own`).toBeGreaterThan(a.fence);
      expect(auditFences, `${a.tag}: stale names an applied fence`).toContain(r.currentFence);
    }
    if (r.status === 'duplicate') expect(auditFences, `${a.tag}: duplicate of an applied fence`).toContain(a.fence);
    if (a.kind === 'modify') expect(a.fnCalled, `${a.tag}: fn runs iff the write applies`).toBe(r.status === 'applied');
  }

  // The highest fence that tried to write did write, and is the row's fence.
  if (o.attempts.length > 0) {
    // biome-ignore lint/complexity/useMathMinMax: bigints; Math.max takes numbers only.
    const highest = o.attempts.reduce((m, a) => (a.fence > m ? a.fence : m), 0n);
    expect(auditFences).toContain(highest);
    expect(o.final.fence).toBe(highest);
  } else {
    expect(o.final.fence).toBe(0n);
  }

  // Values: each change starts from the previous committed value; safe increments add exactly 1.
  let n = 0;
  for (const row of o.audit) {
    expect(row.oldN, `audit ${row.v}: starts from the committed value`).toBe(n);
    const kind = kindOf(row.v);
    if (kind === 'modify' || kind === 'expr') expect(row.newN, `${row.v} adds exactly 1`).toBe(row.oldN + 1);
    if (kind === 'write' || kind === 'upsert') expect(row.newN, `${row.v} leaves n alone`).toBe(row.oldN);
    if (kind === 'naive') {
      const attempt = o.attempts.find((a) => a.tag === row.v);
      expect(row.newN, `${row.v} writes what it read + 1`).toBe((attempt?.read ?? Number.NaN) + 1);
    }
    n = row.newN;
  }
  expect(o.final.n).toBe(n);

  // Reads see a row some applied fence wrote (or the initial one).
  for (const row of o.reads) expect([0n, ...auditFences]).toContain(row?.lastFence);
}

describe.runIf(needs('DATABASE_URL'))('interleavings of lock holders on Postgres (fc.scheduler)', () => {
  let pg: TestDatabase;
  beforeAll(async () => {
    pg = await postgresDatabase();
    await migrate(pg.db);
    await pg.db.execute(sql`create table palisade_prop_counters (
      id text primary key, n integer not null default 0, v text,
      last_fence bigint not null default 0, deleted_at timestamptz)`);
    await pg.db.execute(sql`create table palisade_prop_audit (
      id bigserial primary key, key text not null, fence bigint not null, old_n integer, new_n integer, v text)`);
    // Inside the writing statement, after the row lock: audit ids of one key follow commit order.
    await pg.db.execute(sql`create function palisade_prop_audit() returns trigger language plpgsql as $$
      begin
        insert into palisade_prop_audit (key, fence, old_n, new_n, v) values (new.id, new.last_fence, old.n, new.n, new.v);
        return new;
      end $$`);
    await pg.db.execute(sql`create trigger palisade_prop_audit after update on palisade_prop_counters
      for each row execute function palisade_prop_audit()`);
  });
  afterAll(async () => {
    await pg?.close();
  });

  test.prop([fc.scheduler(), scenarioArb(allOps)], propertyParams())(
    'every interleaving of acquire / read / write / upsert / modify / increment / expire / release keeps the fence order',
    async (s, scenario) => {
      const o = await play(s, pg.db, scenario);
      try {
        checkOutcome(o);
      } catch (error) {
        // The run's calls and results, for the report next to the scheduler's order.
        throw new Error(`${(error as Error).message}\n${describeOutcome(o)}`, { cause: error });
      }
    },
    propertyTimeout(180_000),
  );

  test('a plain get + update with a valid fence can lose an increment: fast-check finds the interleaving', async () => {
    // The same harness, naive increments only; the property "no increment is lost" must be FALSIFIED.
    const naiveOnly = fc.record({
      holders: fc.array(
        fc.array(fc.record({ ops: fc.constant<OpKind[]>(['naive']), release: fc.boolean() }), {
          minLength: 1,
          maxLength: 1,
        }),
        { minLength: 2, maxLength: 2 },
      ),
      overlap: fc.constant([]),
    });
    const result = await fc.check(
      fc.asyncProperty(fc.scheduler(), naiveOnly, async (s, scenario) => {
        const o = await play(s, pg.db, scenario);
        const increments = o.audit.length;
        return o.final.n === increments;
      }),
      { ...propertyParams({ numRuns: Math.min(propertyRuns(), 500) }), verbose: fc.VerbosityLevel.None },
    );
    expect(result.failed, 'expected an interleaving where a naive increment is lost').toBe(true);
    // The shrunk counterexample: two applied increments, final value 1.
    const [s] = result.counterexample ?? [];
    expect(String(s)).toMatch(/naive update/);
  });

  test('modify and SQL-expression increments never lose one, in any of those interleavings', async () => {
    await fc.assert(
      fc.asyncProperty(fc.scheduler(), scenarioArb(safeOps), async (s, scenario) => {
        const o = await play(s, pg.db, scenario);
        const increments = o.audit.filter((a) => ['modify', 'expr'].includes(kindOf(a.v))).length;
        expect(o.final.n).toBe(increments);
      }),
      propertyParams({ numRuns: Math.min(propertyRuns(), 300) }),
    );
  });
});
