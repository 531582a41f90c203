/**
 * What a failure at the COMMIT of a transaction palisade began says about
 * its outcome (`DatabaseError.outcomeUnknown`; README, "When the connection
 * closes inside a transaction"): unknown when no answer of the server's
 * says the COMMIT failed — here node-postgres's `query_timeout`, which gives
 * up on a COMMIT the server goes on to finish — and known (nothing kept)
 * when the server refused the COMMIT. A link lost at the COMMIT is
 * test/repo/near-expiry.test.ts's; one lost before it, lost-connection.test.ts's.
 */
import { sql } from 'drizzle-orm';
import { drizzle as drizzleNodePostgres } from 'drizzle-orm/node-postgres';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import { describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { DatabaseError } from '../../src/errors.js';
import type { Fence } from '../../src/fencing/fence.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { postgresDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

const slow = pgTable('slow', { id: integer('id').primaryKey(), value: text('value').notNull(), ...fenceColumns() });
const holder = () => ({
  fence: 7n as Fence,
  lock: Object.freeze({ kind: 'test', source: 'commit-outcome', namespace: uniqueNamespace(), name: 'L' }),
  signal: new AbortController().signal,
});

// A table whose COMMIT runs a deferred trigger: it sleeps 2 s for value 'slow', and refuses value 'refused'.
async function withTable(fn: (url: string, db: Database) => Promise<void>): Promise<void> {
  const test = await postgresDatabase({ migrated: true });
  try {
    await execute(
      test.db,
      sql.raw(`create table slow (id int primary key, value text not null, last_fence bigint not null default 0, deleted_at timestamptz);
        create function at_commit() returns trigger language plpgsql as $$ begin
          if new.value = 'slow' then perform pg_sleep(2); end if;
          if new.value = 'refused' then raise exception 'refused at commit' using errcode = '23514'; end if;
          return null; end $$;
        create constraint trigger at_commit after update on slow deferrable initially deferred
          for each row execute function at_commit();
        insert into slow (id, value) select g, 'initial' from generate_series(1, 20) g`),
    );
    await fn(test.url as string, test.db);
  } finally {
    await test.close();
  }
}

const nodePostgres = {
  'a node-postgres pool': async (url: string, options: pg.PoolConfig) => {
    const pool = new pg.Pool({ connectionString: url, max: 1, ...options });
    pool.on('error', () => {});
    return { db: drizzleNodePostgres(pool) as unknown as Database, end: () => pool.end() };
  },
  'a single node-postgres Client': async (url: string, options: pg.ClientConfig) => {
    const client = new pg.Client({ connectionString: url, ...options });
    client.on('error', () => {});
    await client.connect();
    return { db: drizzleNodePostgres(client) as unknown as Database, end: () => client.end() };
  },
};
const everyDriver = {
  ...nodePostgres,
  'postgres.js': async (url: string) => {
    const client = postgres(url, { max: 1, onnotice: () => {} });
    return { db: drizzle(client) as unknown as Database, end: () => client.end({ timeout: 1 }) };
  },
};

describe.runIf(needs('DATABASE_URL'))(
  'a failure at the COMMIT of a transaction palisade began',
  { timeout: 60_000 },
  () => {
    for (const [name, open] of Object.entries(nodePostgres)) {
      it(`${name} whose query_timeout gives up on a slow COMMIT: outcomeUnknown, and the server committed`, () =>
        withTable(async (url, db) => {
          // The timeout (500 ms) fires long before the COMMIT (2 s) ends. A machine too busy to see it first gets
          // the COMMIT's answer instead, and one too busy to run an earlier statement within it times that one
          // out (before the COMMIT: the outcome is known, nothing kept): the trial is made again (at most 4 times).
          for (let attempt = 1, id = 1; ; attempt++, id++) {
            const own = await open(url, { query_timeout: 500 });
            const lease = holder();
            const outcome = await fencedTransaction(own.db, lease, () =>
              fencedRepository(own.db, slow).with(lease).update({ id }, { value: 'slow' }),
            ).catch((err: unknown) => err);
            await own.end();
            const atCommit = outcome instanceof DatabaseError && outcome.outcomeUnknown;
            if (!atCommit && attempt < 4) continue;
            expect(outcome).toBeInstanceOf(DatabaseError);
            expect((outcome as DatabaseError).outcomeUnknown, String(outcome)).toBe(true);
            expect((outcome as DatabaseError).message).toMatch(/whether it committed is unknown/);
            // Bounded: the COMMIT the client gave up on ends on the server (at most 50 × 100 ms).
            let value: unknown;
            for (let i = 0; i < 50 && value !== 'slow'; i++, await sleep(100)) {
              value = (await fencedRepository(db, slow).get({ id }))?.value;
            }
            expect(value).toBe('slow');
            return;
          }
        }));
    }

    for (const [name, open] of Object.entries(everyDriver)) {
      it(`${name}, a COMMIT the server refuses: the outcome is known, nothing is kept`, () =>
        withTable(async (url, db) => {
          const own = await open(url, {});
          try {
            const lease = holder();
            const outcome = await fencedTransaction(own.db, lease, () =>
              fencedRepository(own.db, slow).with(lease).update({ id: 1 }, { value: 'refused' }),
            ).catch((err: unknown) => err);
            expect(outcome).toBeInstanceOf(DatabaseError);
            expect([(outcome as DatabaseError).sqlState, (outcome as DatabaseError).outcomeUnknown]).toEqual([
              '23514',
              false,
            ]);
            expect((await fencedRepository(db, slow).get({ id: 1 }))?.value).toBe('initial');
          } finally {
            await own.end();
          }
        }));
    }
  },
);
