/**
 * Section 4 — end to end: acquire → read-modify-write one row → release.
 *
 * - palisade, per backend: `repo.with(lease).modify(key, row => balance + 1)`
 *   (row lock + fenced write in one transaction);
 * - palisade Redis with `repo.with(lease).update(key, { balance: sql\`balance + 1\` })`
 *   (one statement: the increment as an SQL expression);
 * - the best Redis peer (fastest in section 2, redis-semaphore otherwise)
 *   plus a hand-written, prepared fenced `UPDATE … SET balance = balance + 1`
 *   — what a careful user would write without palisade (fence from an
 *   in-process counter, since the peers issue none).
 *
 * Serial (one name, one row) and 16 clients (16 names, each its own row).
 */
import { sql as dsql } from 'drizzle-orm';
import { fencedRepository } from '../../src/repo/repository.js';
import type { BenchContext } from '../lib/context.js';
import {
  type LockUnderTest,
  palisadeAdvisory,
  palisadePostgres,
  palisadeRedis,
  redisSemaphore,
  redlock,
} from '../lib/locks.js';
import { type Case, compare, type Measured } from '../lib/measure.js';
import { ms, ops, printTable, ratio } from '../lib/report.js';
import { createAccounts, makeAccounts } from '../lib/tables.js';
import { namePool } from './lock-round-trips.js';

const WAIT_MS = 2_000;

export async function endToEnd(ctx: BenchContext): Promise<void> {
  const { report, scale } = ctx;
  const name = 'bench_e2e';
  // Each case writes rows of its own: fences of different sources are not comparable.
  await createAccounts(ctx.pg.sql, name, 16 * 8);
  const table = makeAccounts(name);
  const repo = fencedRepository(ctx.pg.db, table);
  const redisLock = palisadeRedis(ctx, 'e2e');
  const redisManager = redisLock.manager as NonNullable<LockUnderTest['manager']>;
  const palisadeLocks: LockUnderTest[] = [redisLock, palisadePostgres(ctx, 'e2e')];
  const advisory = await palisadeAdvisory(ctx, 'e2e');
  if (advisory) palisadeLocks.push(advisory);
  const bestPeerName = (() => {
    const m = (ctx.report.raw.lockRoundTrips as Record<string, Measured[]> | undefined)?.['serial, one name'];
    const peers = m?.filter((r) => !r.name.startsWith('palisade') && !r.name.startsWith('syncguard'));
    return peers?.reduce((a, b) => (b.opsPerSec > a.opsPerSec ? b : a)).name ?? 'redis-semaphore Mutex';
  })();
  const peer = bestPeerName.startsWith('redlock') ? redlock(ctx) : redisSemaphore(ctx);
  const sql = ctx.pg.sql;
  let localFence = 0n;
  try {
    let caseNo = 0;
    const pooled = (label: string, body: (id: number, lockName: string) => Promise<void>, names: number): Case => {
      const pool = namePool(label, names);
      const offset = 16 * caseNo++;
      return {
        name: label,
        fn: async () => {
          const lockName = pool.take();
          try {
            await body(offset + Number(lockName.slice(lockName.lastIndexOf('-') + 1)) + 1, lockName);
          } finally {
            pool.give(lockName);
          }
        },
      };
    };
    const cases = (names: number): Case[] => {
      caseNo = 0;
      return [
        ...palisadeLocks.map((lock) =>
          pooled(
            `${lock.label} + repository.modify`,
            async (id, lockName) => {
              const lease = await (lock.manager as NonNullable<LockUnderTest['manager']>).acquire(lockName, {
                ttlMs: 10_000,
                waitMs: WAIT_MS,
              });
              try {
                const r = await repo.with(lease).modify({ id }, (row) => ({ balance: row.balance + 1 }));
                if (r.status !== 'applied') throw new Error(`modify: ${r.status}`);
              } finally {
                await lease.release();
              }
            },
            names,
          ),
        ),
        pooled(
          'palisade Redis + repository.update(balance + 1 as SQL)',
          async (id, lockName) => {
            const lease = await redisManager.acquire(lockName, {
              ttlMs: 10_000,
              waitMs: WAIT_MS,
            });
            try {
              const r = await repo.with(lease).update({ id }, { balance: dsql`${table.balance} + 1` });
              if (r.status !== 'applied') throw new Error(`update: ${r.status}`);
            } finally {
              await lease.release();
            }
          },
          names,
        ),
        pooled(
          `${peer.label} + hand-written fenced UPDATE`,
          async (id, lockName) => {
            const held = await peer.acquire(lockName, WAIT_MS);
            try {
              localFence += 1n;
              const f = String(1_000_000_000_000n + localFence);
              const rows = await sql`update bench_e2e set balance = balance + 1, last_fence = ${f}
              where id = ${id} and last_fence < ${f} returning *`;
              if (rows.length !== 1) throw new Error('hand-written update did not apply');
            } finally {
              await held.release();
            }
          },
          names,
        ),
      ];
    };
    const results: Record<string, Measured[]> = {};
    for (const concurrency of [1, 16]) {
      const label = concurrency === 1 ? 'serial, one lock and row' : `${concurrency} clients, distinct locks and rows`;
      const m = await compare(cases(concurrency), { concurrency, rounds: scale.rounds, timeMs: scale.timeMs });
      results[label] = m;
      const base = m[m.length - 1] as Measured;
      const t = report.table('4. End to end (acquire → modify → release)', label, [
        'case',
        'cycles/s',
        'p50 ms',
        'p99 ms',
        '× peer + hand-written',
      ]);
      for (const r of m)
        t.rows.push([r.name, ops(r.opsPerSec), ms(r.p50Ms), ms(r.p99Ms), ratio(r.opsPerSec / base.opsPerSec)]);
      t.notes.push(
        `The peer is ${peer.label} (the fastest Redis peer of section 2); its fence comes from an in-process counter. modify = BEGIN, SELECT … FOR UPDATE, fenced UPDATE, COMMIT (4 round trips); the hand-written UPDATE is 1.`,
      );
      printTable(t);
    }
    report.raw.endToEnd = results;
  } finally {
    for (const l of [...palisadeLocks, peer]) await l.close();
  }
}
