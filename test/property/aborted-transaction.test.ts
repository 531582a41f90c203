/**
 * A fenced transaction whose statements fail (README, "Fenced
 * transactions"), searched on every driver: PGlite always, and postgres.js,
 * a node-postgres pool and a single node-postgres `Client` on the real
 * Postgres. Each run draws what the function does — lock-scoped writes,
 * plain statements, a failing statement whose error is caught, one sent
 * without being awaited a few microtasks on (perhaps after the function
 * returned), savepoints that commit or fail inside and roll back — and the
 * check is the promise: the call applies with every write of the model
 * visible, or it rejects and nothing is visible — never applied with
 * anything missing; a failure it awaited and caught always makes it
 * reject; with no failure at all it applies. (Whether a statement left
 * unawaited ran inside the transaction or after it is the driver's timing:
 * such a run is held to the first rule alone.)
 */
import { fc, test } from '@fast-check/vitest';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { afterAll, beforeAll, describe } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import type { Lease } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { everyTransactionDriver, type TestDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });
const ROWS = 4;

type Step =
  | { readonly t: 'write'; readonly row: number }
  | { readonly t: 'plain'; readonly row: number }
  | { readonly t: 'fail' }
  | { readonly t: 'stray'; readonly ticks: number }
  | { readonly t: 'savepoint'; readonly row: number; readonly failInside: boolean };

const row = fc.integer({ min: 1, max: ROWS });
const stepArb: fc.Arbitrary<Step> = fc.oneof(
  { weight: 3, arbitrary: fc.record({ t: fc.constant('write' as const), row }) },
  fc.record({ t: fc.constant('plain' as const), row }),
  fc.record({ t: fc.constant('fail' as const) }),
  fc.record({ t: fc.constant('stray' as const), ticks: fc.integer({ min: 0, max: 8 }) }),
  fc.record({ t: fc.constant('savepoint' as const), row, failInside: fc.boolean() }),
);

const drivers = everyTransactionDriver;

for (const { name, open, real } of drivers) {
  describe.runIf(!real || needs('DATABASE_URL'))(`${name}: a fenced transaction whose statements fail`, () => {
    let t: TestDatabase | undefined;
    let locks: LockManager | undefined;
    let run = 0;
    beforeAll(async () => {
      t = await open();
      await migrate(t.db);
      await execute(
        t.db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(t.db, sql`insert into resource (id, value) select g, 'initial' from generate_series(1, ${ROWS}) g`);
      locks = postgresLockManager({ client: t.db, namespace: 'abortprop' });
    }, 120_000);
    afterAll(async () => {
      await locks?.close();
      await t?.close();
    });

    test.prop([fc.array(stepArb, { minLength: 1, maxLength: 6 })], propertyParams({ numRuns: propertyRuns(60) }))(
      'applied with every write visible, or rejected with nothing visible; a caught failure always rejects, no failure always applies',
      async (steps) => {
        const db = (t as TestDatabase).db;
        await execute(db, sql`update resource set value = 'initial', last_fence = 0`);
        const repo = fencedRepository(db, resource, { sameFence: 'allow' });
        const lease: Lease = await (locks as LockManager).acquire(`L${++run}`, { ttlMs: 60_000 });
        const model = new Map<number, string>(Array.from({ length: ROWS }, (_, i) => [i + 1, 'initial']));
        let failed = false;
        let wrote = 0;
        const serverFailure = (e: unknown) => {
          if (e instanceof DatabaseError) failed = true;
        };
        const outcome = await fencedTransaction(db, lease, async (tx) => {
          for (const s of steps) {
            const v = `w${++wrote}`;
            if (s.t === 'write') {
              const r = await repo.with(lease).update({ id: s.row }, { value: v });
              if (r.status !== 'applied') throw new Error(`write ${r.status}`);
              model.set(s.row, v);
            } else if (s.t === 'plain') {
              await execute(tx, sql`update resource set value = ${v} where id = ${s.row}`);
              model.set(s.row, v);
            } else if (s.t === 'fail') {
              await execute(tx, sql`select 1 / 0`).catch(serverFailure);
            } else if (s.t === 'stray') {
              void (async () => {
                for (let i = 0; i < s.ticks; i++) await null;
                await execute(tx, sql`select 1 / 0`);
              })().catch(() => {});
            } else {
              const done = await tx
                .transaction(async (sp) => {
                  await execute(sp as unknown as Database, sql`update resource set value = ${v} where id = ${s.row}`);
                  // Fails, so drizzle rolls back to the savepoint and rejects: the transaction goes on.
                  if (s.failInside) await execute(sp as unknown as Database, sql`select 1 / 0`);
                })
                .then(
                  () => true,
                  () => false,
                );
              if (done) model.set(s.row, v);
            }
          }
        }).catch((err: unknown) => err);
        const seen = await execute(db, sql`select id, value from resource order by id`);
        const visible = new Map(seen.map((r) => [Number(r.id), String(r.value)]));
        await lease.release();
        if (outcome instanceof Error) {
          const healthy = !steps.some((s) => s.t === 'fail' || s.t === 'stray');
          if (healthy) throw outcome;
          for (const [id, value] of visible)
            if (value !== 'initial') throw new Error(`rejected, row ${id} visible: ${value}`);
        } else {
          if (failed) throw new Error(`applied after a failed statement: ${JSON.stringify(outcome)}`);
          if ((outcome as { status?: unknown }).status !== 'applied')
            throw new Error(`not applied: ${String(outcome)}`);
          for (const [id, value] of model) {
            if (visible.get(id) !== value) throw new Error(`applied, row ${id}: ${visible.get(id)}, model ${value}`);
          }
        }
      },
      propertyTimeout(300_000),
    );
  });
}
