/**
 * A fenced transaction that waits for a connection (a pool whose every
 * connection is busy) bounds its idle time by the lease's TTL left when it
 * claims, not when it was called: a holder paused in it right after the
 * wait must not keep the register past its lease (README, "Fenced
 * transactions").
 */

import { performance } from 'node:perf_hooks';
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import { drizzle as drizzlePostgres } from 'drizzle-orm/postgres-js';
import pg from 'pg';
import postgres from 'postgres';
import { describe, expect, it } from 'vitest';
import { type Database, execute } from '../../src/driver.js';
import { LeaseLostError } from '../../src/errors.js';
import { toFence } from '../../src/fencing/fence.js';
import { fencedTransaction } from '../../src/repo/fenced-transaction.js';
import { postgresDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

const TTL_MS = 4_000;
const BUSY_S = 2;

const pools = {
  'postgres.js, one connection': async (url: string) => {
    const client = postgres(url, { max: 1, onnotice: () => {} });
    return { db: drizzlePostgres(client) as unknown as Database, end: () => client.end({ timeout: 1 }) };
  },
  'node-postgres, a pool of one': async (url: string) => {
    const pool = new pg.Pool({ connectionString: url, max: 1 });
    pool.on('error', () => {});
    return { db: drizzle(pool) as unknown as Database, end: () => pool.end() };
  },
};

describe.runIf(needs('DATABASE_URL'))('a fenced transaction that waits for a connection', { timeout: 60_000 }, () => {
  for (const [name, open] of Object.entries(pools)) {
    it(`${name}: its idle bound is the TTL left at the claim, after the wait`, async () => {
      const base = await postgresDatabase({ migrated: true });
      const own = await open(base.url as string);
      try {
        const lease = {
          fence: toFence(7),
          lock: Object.freeze({ kind: 'test', source: 'pool-wait', namespace: uniqueNamespace(), name: 'L' }),
          signal: new AbortController().signal,
          expiresAt: performance.now() + TTL_MS,
        };
        // The only connection is busy for BUSY_S seconds; the transaction is called meanwhile and waits for it.
        const busy = execute(own.db, sql.raw(`select pg_sleep(${BUSY_S})`));
        // Running on the server before the transaction is called (bounded: 200 × 10 ms).
        for (let i = 0; i < 200; i++) {
          const [row] = await execute(
            base.db,
            sql`select count(*)::int as n from pg_stat_activity where datname = current_database() and query like 'select pg_sleep%'`,
          );
          if (row?.n === 1) break;
          await sleep(10);
        }
        let freedAt = 0;
        void busy.then(() => {
          freedAt = performance.now();
        });
        const outcome = await fencedTransaction(own.db, lease, async (tx) => {
          const [row] = await execute(
            tx,
            sql`select (extract(epoch from current_setting('idle_in_transaction_session_timeout')::interval) * 1000)::int8 as ms`,
          );
          return Number(row?.ms);
        }).catch((err: unknown) => err);
        await busy;
        // At least BUSY_S seconds of the TTL went by before the claim: what is left is at most TTL - BUSY_S
        // (a machine slow enough to use it all gets LeaseLostError, and nothing was sent with a stale bound).
        if (outcome instanceof LeaseLostError) return;
        expect(outcome).toMatchObject({ status: 'applied' });
        const bound = (outcome as { value: number }).value;
        expect(bound).toBeGreaterThan(0);
        // Claimed once the connection was free: at most the TTL left then (give or take the turn between the
        // driver handing the connection on and the busy statement's answer; the bound is whole ms).
        expect(bound).toBeLessThanOrEqual(lease.expiresAt - freedAt + 50);
      } finally {
        await own.end();
        await base.close();
      }
    });
  }
});
