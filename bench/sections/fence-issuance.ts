/**
 * Section 5 — what it costs to be handed a fence, by source:
 *
 * - Redis `INCR` on a plain key (the floor of any Redis counter);
 * - palisade's Redis grant script (the lock key with its grant record and
 *   the fence, one script);
 * - Postgres `nextval('palisade.fence_seq')` (prepared);
 * - palisade's Postgres lease grant (one statement: row + nextval).
 *
 * The two grants run on a fresh lock name each time (never released; the
 * Redis keys expire after 1 s, the lease rows stay), so they measure the
 * grant alone. Serial and 16 concurrent.
 */
import { randomBytes } from 'node:crypto';
import { drizzle } from 'drizzle-orm/postgres-js';
import type { Database } from '../../src/driver.js';
import type { LockBackend } from '../../src/fencing/backend.js';
import { postgresLockBackend } from '../../src/fencing/backends/postgres-lease/backend.js';
import { redisLockBackend } from '../../src/fencing/backends/redis/backend.js';
import type { BenchContext } from '../lib/context.js';
import { type Case, compare, type Measured } from '../lib/measure.js';
import { ms, ops, printTable, ratio } from '../lib/report.js';

/** JSON with bigints and dates as text. */
const stringify = (value: unknown): string =>
  JSON.stringify(value, (_, v) => (typeof v === 'bigint' ? v.toString() : v));

export async function fenceIssuance(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const redis = ctx.redis.client();
  const pgClient = ctx.pg.client(20);
  const db = drizzle(pgClient) as unknown as Database;
  const redisBackend = redisLockBackend({
    client: redis,
    namespace: `${ctx.redis.prefix}fences`.replaceAll(':', '.'),
    epochs: ctx.pg.db,
  });
  const pgBackend = postgresLockBackend({ client: db, namespace: 'fences', listen: false });
  let n = 0;
  const token = () => randomBytes(16).toString('hex');
  // A fresh name is never taken: if one is, say which backend, which name and what holds it.
  const refused = async (backend: LockBackend, name: string): Promise<never> => {
    const held = await backend.inspect(name).catch((err: unknown) => `inspect failed: ${String(err)}`);
    throw new Error(`${backend.kind} grant refused on the fresh name ${name}; inspect: ${stringify(held)}`);
  };
  const counterKey = `${ctx.redis.prefix}bench:counter`;
  const cases: Case[] = [
    { name: 'Redis INCR (plain counter)', fn: () => redis.incr(counterKey) },
    {
      name: 'palisade Redis grant script',
      fn: async () => {
        const name = `g${n++}`;
        if (!(await redisBackend.grant(name, token(), 1_000, null))) await refused(redisBackend, name);
      },
    },
    {
      name: "Postgres nextval('palisade.fence_seq')",
      fn: () => pgClient`select nextval('palisade.fence_seq')`.execute(),
    },
    {
      name: 'palisade Postgres lease grant',
      fn: async () => {
        const name = `g${n++}`;
        if (!(await pgBackend.grant(name, token(), 60_000, null))) await refused(pgBackend, name);
      },
    },
  ];
  try {
    const results: Record<string, Measured[]> = {};
    for (const concurrency of [1, 16]) {
      const label = concurrency === 1 ? 'serial' : `${concurrency} concurrent`;
      const m = await compare(cases, { concurrency, rounds: scale.rounds, timeMs: scale.timeMs });
      results[label] = m;
      const incr = m[0] as Measured;
      const t = report.table('5. Fence issuance', label, ['source', 'fences/s', 'p50 ms', 'p99 ms', '× Redis INCR']);
      for (const r of m)
        t.rows.push([r.name, ops(r.opsPerSec), ms(r.p50Ms), ms(r.p99Ms), ratio(r.opsPerSec / incr.opsPerSec)]);
      t.notes.push(
        "Grants run on a fresh lock name each call (the insert path for the lease table). The advisory backend draws its fence from the same sequence inside pg_try_advisory_lock's statement, on a dedicated session; it is covered by sections 2–4.",
      );
      printTable(t);
    }
    report.raw.fenceIssuance = results;
  } finally {
    await redisBackend.close();
    await pgBackend.close();
    redis.disconnect();
  }
}
