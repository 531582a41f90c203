/**
 * Lock-scoped fencing (README, "Two scopes of fencing"): the
 * per-row scenario on every backend with the newer holder in another OS
 * process, a holder SIGSTOPped inside a fenced transaction, concurrency
 * without self-blocking or hangs, forged fences and the register reset.
 */
import { execFileSync } from 'node:child_process';
import { type AddressInfo, connect, createServer } from 'node:net';
import { PGLiteSocketServer } from '@electric-sql/pglite-socket';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { drizzle as drizzlePglite } from 'drizzle-orm/pglite';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { afterEach, describe, expect, it } from 'vitest';
import { type Database, execute, transaction } from '../../src/driver.js';
import { FenceNotIssuedError, LockScopeError, StaleFenceError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import type { Fence } from '../../src/fencing/fence.js';
import type { Lease } from '../../src/fencing/lease.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { fencedTransaction, fencedTransactionOrThrow } from '../../src/repo/fenced-transaction.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { registerTag } from '../../src/repo/register-key.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { killAllCli, runCli } from '../support/cli.js';
import { everyTransactionDriver, pgliteDatabase } from '../support/databases.js';
import { type EtcdCluster, startEtcdCluster } from '../support/etcd-cluster.js';
import { type BackendKind, type ManagerConfig, openManager } from '../support/managers.js';
import { newPglite } from '../support/pglite.js';
import { killAllWorkers, startWorker } from '../support/processes.js';
import { scenarioDatabase, uniqueNamespace } from '../support/scenario.js';
import { needs, services } from '../support/services.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });
const WORKER = 'test/workers/lock-scope-worker.ts';

afterEach(async () => {
  await killAllWorkers();
  await killAllCli();
});

// A holder that has not noticed it lost the lease (paused): its signal never fired.
const unaware = (lease: Lease) => ({ fence: lease.fence, lock: lease.lock, signal: new AbortController().signal });

async function withScenario(
  rows: number,
  fn: (url: string, db: Awaited<ReturnType<typeof scenarioDatabase>>) => Promise<void>,
) {
  const scenario = await scenarioDatabase();
  try {
    await scenario.db.execute(
      sql`insert into resource (id, value) select g, 'initial' from generate_series(2, ${rows}) g`,
    );
    await fn(scenario.url as string, scenario);
  } finally {
    await scenario.close();
  }
}

const backends: { kind: BackendKind; enabled: boolean }[] = [
  { kind: 'postgres', enabled: needs('DATABASE_URL') },
  { kind: 'advisory', enabled: needs('DATABASE_URL') },
  { kind: 'redis', enabled: needs('DATABASE_URL') && needs('REDIS_URL') },
  { kind: 'etcd', enabled: needs('DATABASE_URL') && needs('ETCD') },
];

describe('the per-row scenario: a newer holder in another process writes X only; the old holder writes Y', () => {
  for (const { kind, enabled } of backends) {
    it.runIf(enabled)(
      `${kind}: through with(lease) Y is stale; through the bare fence it still applies`,
      { timeout: 120_000 },
      async () => {
        let cluster: EtcdCluster | undefined;
        if (kind === 'etcd') cluster = await startEtcdCluster(1);
        try {
          await withScenario(2, async (url) => {
            const config: ManagerConfig = {
              kind,
              namespace: uniqueNamespace('scope'),
              databaseUrl: url,
              redisUrl: services.redis.url,
              etcdEndpoints: cluster?.endpoints,
            };
            const a = await openManager(config);
            const b = startWorker(WORKER, { ...config, ttlMs: 60_000 });
            try {
              const repo = fencedRepository(a.db, resource);
              // A holds fence 41 (say) and pauses: its TTL runs out, the lock is free again.
              const leaseA = await a.manager.acquire('L', { ttlMs: 1_500, autoExtend: false });
              expect(leaseA.lock).toMatchObject({ kind, namespace: config.namespace, name: 'L' });
              await b.next((m) => m.event === 'ready');
              b.send({ cmd: 'acquire', lock: 'L' });
              const granted = await b.next((m) => m.event === 'acquired' || m.event === 'error', 60_000);
              expect(granted.event).toBe('acquired');
              const fenceB = BigInt(String(granted.fence));
              expect(fenceB).toBeGreaterThan(leaseA.fence);
              b.send({ cmd: 'write', lock: 'L', id: 1, value: 'B' });
              expect((await b.next((m) => m.event === 'write')).status).toBe('applied');
              // A wakes up and writes the row B never touched.
              const scoped = await repo.with(unaware(leaseA)).update({ id: 2 }, { value: 'A late' });
              expect(scoped).toEqual({ status: 'stale', currentFence: fenceB });
              expect((await repo.get({ id: 2 }))?.value).toBe('initial');
              // Row scope (the design card's shape) refuses only rows a higher fence wrote.
              expect((await repo.update({ id: 1 }, leaseA.fence, { value: 'A' })).status).toBe('stale');
              expect((await repo.update({ id: 2 }, leaseA.fence, { value: 'A bare' })).status).toBe('applied');
            } finally {
              b.kill();
              await a.close();
            }
          });
        } finally {
          await cluster?.stop();
        }
      },
    );
  }
});

describe.runIf(needs('DATABASE_URL'))('lock scope on the Postgres lease backend', { timeout: 120_000 }, () => {
  // The holder writes row 1 (or is about to), says `inside`, and is SIGSTOPped there. modify (like
  // upsert and updateWhere) claims in a transaction of its own: a regression left it without the idle
  // bound, so a holder paused inside it kept the register row locked and no grant got through.
  const paused = [
    {
      what: 'a fenced transaction: its commit fails',
      cmd: 'pausedTransaction',
      ends: 'transaction',
      inside: 'applied',
    },
    { what: "a lock-scoped modify's function", cmd: 'pausedModify', ends: 'modify', inside: 'claimed' },
    // The modify's own claim once raised the transaction's 1 s bound to its holder's 60 s (found by a
    // chaos run: a paused holder kept every grant out for seconds).
    {
      what: 'a fenced transaction bounded by idleTimeoutMs, after a lock-scoped modify in it',
      cmd: 'pausedModifyInTransaction',
      ends: 'transaction',
      inside: 'applied',
    },
  ] as const;
  for (const { what, cmd, ends, inside } of paused) {
    it(`a holder SIGSTOPped inside ${what}; the next acquire succeeds, nothing it wrote is visible`, async () => {
      await withScenario(2, async (url) => {
        const config: ManagerConfig = { kind: 'postgres', namespace: uniqueNamespace('stop'), databaseUrl: url };
        const holder = startWorker(WORKER, { ...config, ttlMs: 1_500 });
        const next = await openManager(config);
        try {
          await holder.next((m) => m.event === 'ready');
          holder.send({ cmd: 'acquire', lock: 'L' });
          await holder.next((m) => m.event === 'acquired');
          holder.send({ cmd, lock: 'L', id: 1, value: 'paused', idleMs: 60_000, txIdleMs: 1_000 });
          expect((await holder.next((m) => m.event === 'inside')).status).toBe(inside);
          holder.pause();
          // TTL 1.5 s + an idle timeout ≤ the TTL left: bounded by waitMs, never asserted on time.
          const lease = await next.manager.acquire('L', { ttlMs: 60_000, waitMs: 30_000 });
          const repo = fencedRepository(next.db, resource);
          expect((await repo.with(lease).update({ id: 2 }, { value: 'next' })).status).toBe('applied');
          holder.resume();
          const ended = await holder.next((m) => m.event === ends, 60_000);
          expect(ended.status).not.toBe('applied');
          expect((await repo.get({ id: 1 }))?.value).toBe('initial');
        } finally {
          holder.kill();
          await next.close();
        }
      });
    });
  }

  // postgres.js sends a statement new on its connection described first (Parse, Describe, Flush — no
  // Sync) and binds it when the description is back. In between, the server waits for the client
  // without having said it is ready, so it never counts the transaction as idle and its idle bound
  // cannot fire (migration 0009). A proxy between the holder and Postgres SIGSTOPs the holder exactly
  // there. Before the grant ended such a session, the lock stayed out of reach for the whole pause.
  // Each backend raises the register its own way: the lease and advisory grants (register_grant), the
  // Redis holder's first lock-scoped write (claim_lock). The paused holder only shares the register
  // (a write of its lease raised it first); a holder whose own transaction raised it is not ended.
  const raisers = [
    { kind: 'postgres', by: 'the next grant', enabled: true },
    { kind: 'advisory', by: 'the next grant', enabled: true },
    { kind: 'redis', by: "the next holder's first lock-scoped write", enabled: needs('REDIS_URL') },
  ] as const;
  for (const { kind, by, enabled } of raisers) {
    it.runIf(enabled)(
      `${kind}, postgres.js: a holder SIGSTOPped between a statement’s description and its execution: ${by} ends its session; nothing it wrote lands`,
      async () => {
        await withScenario(2, async (url) => {
          const target = new URL(url);
          const FLUSH = Buffer.from([0x48, 0, 0, 0, 4]);
          let holder: ReturnType<typeof startWorker> | undefined;
          let armed = false;
          let stopped = false;
          const proxy = createServer((inbound) => {
            const outbound = connect(Number(target.port || 5432), '127.0.0.1');
            inbound.on('data', (chunk: Buffer) => {
              if (chunk.includes('palisade_describe_window') && chunk.includes(FLUSH)) armed = true;
              outbound.write(chunk);
            });
            outbound.on('data', (chunk: Buffer) => {
              // The description is back: stop the holder before it can read it and bind.
              if (armed && !stopped && holder) {
                stopped = true;
                holder.pause();
              }
              inbound.write(chunk);
            });
            // A session the server ends closes the holder's side too, as it would without the proxy.
            inbound.on('close', () => outbound.destroy());
            outbound.on('close', () => inbound.destroy());
            inbound.on('error', () => {});
            outbound.on('error', () => {});
          });
          await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve));
          const proxied = new URL(url);
          proxied.host = `127.0.0.1:${(proxy.address() as AddressInfo).port}`;
          const config: ManagerConfig = {
            kind,
            namespace: uniqueNamespace('describe'),
            databaseUrl: url,
            redisUrl: services.redis.url,
          };
          const next = await openManager(config);
          try {
            holder = startWorker(WORKER, { ...config, databaseUrl: proxied.toString(), ttlMs: 1_500 });
            await holder.next((m) => m.event === 'ready');
            holder.send({ cmd: 'acquire', lock: 'L' });
            await holder.next((m) => m.event === 'acquired');
            holder.send({ cmd: 'write', lock: 'L', id: 2, value: 'holder' });
            expect((await holder.next((m) => m.event === 'write')).status).toBe('applied');
            holder.send({ cmd: 'pausedAtDescribe', lock: 'L', id: 1, value: 'paused' });
            for (let i = 0; i < 600 && !stopped; i++) await new Promise((resolve) => setTimeout(resolve, 50));
            expect(stopped).toBe(true);
            const stalled = sql`select state, wait_event from pg_stat_activity where query like '%palisade_describe_window%' and pid <> pg_backend_pid()`;
            const sessions = async () => [
              ...((await next.db.execute(stalled)) as unknown as Record<string, unknown>[]),
            ];
            expect(await sessions()).toEqual([{ state: 'active', wait_event: 'ClientRead' }]);
            // TTL 1.5 s: bounded by waitMs, never asserted on time.
            const lease = await next.manager.acquire('L', { ttlMs: 60_000, waitMs: 30_000 });
            const repo = fencedRepository(next.db, resource);
            if (kind === 'redis')
              expect((await repo.with(lease).update({ id: 2 }, { value: 'next' })).status).toBe('applied');
            // Ended, not waited out: its session goes (the backend exits right after it let the row go).
            for (let i = 0; i < 200 && (await sessions()).length > 0; i++) await new Promise((r) => setTimeout(r, 50));
            expect(await sessions()).toEqual([]);
            holder.resume();
            const ended = await holder.next((m) => m.event === 'transaction', 60_000);
            expect(ended).toMatchObject({ status: 'error', code: 'lease_lost' });
            expect((await repo.get({ id: 1 }))?.value).toBe('initial');
            expect((await repo.with(lease).update({ id: 1 }, { value: 'next' })).status).toBe('applied');
            expect((await repo.get({ id: 1 }))?.value).toBe('next');
          } finally {
            holder?.kill();
            await next.close();
            proxy.close();
          }
        });
      },
    );
  }

  it("a lock-scoped write in a caller's transaction bounds its idle time, and never loosens a tighter bound", async () => {
    await withScenario(2, async (url) => {
      const m = await openManager({ kind: 'postgres', namespace: uniqueNamespace('idle'), databaseUrl: url });
      try {
        const lease = await m.manager.acquire('L', { ttlMs: 60_000 });
        const bound = async (tx: typeof m.db) => {
          const rows = await tx.execute(sql`select current_setting('idle_in_transaction_session_timeout') as v`);
          return String((rows as unknown as { v: string }[])[0]?.v);
        };
        await m.db.transaction(async (tx) => {
          const r = await fencedRepository(tx, resource)
            .with(lease)
            .modify({ id: 1 }, () => ({ value: 'a' }));
          expect(r.status).toBe('applied');
          // The lease's TTL left, under a minute: not the server's default (no bound).
          expect(['0', '1min']).not.toContain(await bound(tx));
        });
        await m.db.transaction(async (tx) => {
          await tx.execute(sql`select set_config('idle_in_transaction_session_timeout', '250', true)`);
          const r = await fencedRepository(tx, resource)
            .with(lease)
            .modify({ id: 2 }, () => ({ value: 'b' }));
          expect(r.status).toBe('applied');
          expect(await bound(tx)).toBe('250ms');
        });
        await lease.release();
      } finally {
        await m.close();
      }
    });
  });

  // What a raise reads to find a stalled sharer (migrations 0009, 0010): every statement that keeps a claim
  // past its end tags the transaction with each register's tag at its fence, in whichever form palisade sends it.
  it('every claim kept past its statement tags its transaction as the register’s sharer', async () => {
    await withScenario(2, async (url) => {
      const m = await openManager({ kind: 'postgres', namespace: uniqueNamespace('tag'), databaseUrl: url });
      try {
        const a = await m.manager.acquire('A', { ttlMs: 60_000 });
        const b = await m.manager.acquire('B', { ttlMs: 60_000 });
        const repo = fencedRepository(m.db, resource);
        const tags = async (tx: typeof m.db) => {
          const rows = (await tx.execute(
            sql`select classid::int8 as k1, objid::int8 as k2 from pg_locks
              where pid = pg_backend_pid() and locktype = 'advisory' and objsubid = 2 and granted order by 1, 2`,
          )) as unknown as { k1: unknown; k2: unknown }[];
          return rows.map((r) => [Number(r.k1), Number(r.k2)]);
        };
        const tagOf = (lease: Lease) => {
          if (!lease.lock) throw new Error('every built-in lease has a lock');
          return [...registerTag(lease.lock, lease.fence)];
        };
        const sorted = (xs: number[][]) =>
          [...xs].sort((x, y) => (x[0] ?? 0) - (y[0] ?? 0) || (x[1] ?? 0) - (y[1] ?? 0));
        // One lease (claim_lock with its bound), two (claim_locks), and a lock-scoped write in your transaction.
        await fencedTransaction(m.db, a, async (tx) => expect(await tags(tx)).toEqual([tagOf(a)]));
        await fencedTransaction(m.db, [a, b], async (tx) =>
          expect(await tags(tx)).toEqual(sorted([tagOf(a), tagOf(b)])),
        );
        await m.db.transaction(async (tx) => {
          expect(await tags(tx)).toEqual([]);
          expect((await fencedRepository(tx, resource).with(b).update({ id: 2 }, { value: 'x' })).status).toBe(
            'applied',
          );
          expect(await tags(tx)).toEqual([tagOf(b)]);
        });
        expect((await repo.with(a).modify({ id: 1 }, () => ({ value: 'y' }))).status).toBe('applied');
      } finally {
        await m.close();
      }
    });
  });

  it("every transaction a lock-scoped update claims in is bounded by that update's lease", async () => {
    // Found by an attack on the idle bound: the update's claim (in its own statement) set no bound, so in
    // a transaction palisade opened for a row-scoped modify, in a fenced transaction of another lease, or
    // around claimLockRegister, a holder paused there kept the register row locked for that lease's TTL
    // or with no bound at all.
    await withScenario(4, async (url) => {
      const m = await openManager({ kind: 'postgres', namespace: uniqueNamespace('bound'), databaseUrl: url });
      try {
        const short = await m.manager.acquire('S', { ttlMs: 5_000 });
        const long = await m.manager.acquire('M', { ttlMs: 120_000 });
        const repo = fencedRepository(m.db, resource);
        const boundMs = async (tx: typeof m.db) => {
          const rows = await tx.execute(
            sql`select extract(epoch from current_setting('idle_in_transaction_session_timeout')::interval) * 1000 as ms`,
          );
          return Number((rows as unknown as { ms: unknown }[])[0]?.ms);
        };
        const bounded = (ms: number) => expect(ms > 0 && ms <= 5_000, `idle bound ${ms} ms`).toBe(true);

        const modified = await repo.modify({ id: 1 }, long.fence, async (_row, tx) => {
          expect((await repo.with(short).update({ id: 2 }, { value: 'in a row-scoped modify' })).status).toBe(
            'applied',
          );
          bounded(await boundMs(tx));
          return { value: 'modified' };
        });
        expect(modified.status).toBe('applied');

        const result = await fencedTransaction(m.db, long, async (tx) => {
          expect(await boundMs(tx)).toBeGreaterThan(5_000);
          expect((await repo.with(short).update({ id: 3 }, { value: 'in another lease' })).status).toBe('applied');
          bounded(await boundMs(tx));
        });
        expect(result.status).toBe('applied');

        // A bound set inside a savepoint goes when the savepoint rolls back: the write after it bounds again.
        const rolledBack = await fencedTransaction(m.db, long, async (tx) => {
          await tx
            .transaction(async () => {
              expect((await repo.with(short).update({ id: 4 }, { value: 'rolled back' })).status).toBe('applied');
              throw new Error('roll the savepoint back');
            })
            .catch(() => {});
          expect(await boundMs(tx)).toBeGreaterThan(5_000);
          expect((await repo.with(short).update({ id: 4 }, { value: 'after the savepoint' })).status).toBe('applied');
          bounded(await boundMs(tx));
        });
        expect(rolledBack.status).toBe('applied');

        await m.db.transaction(async (tx) => {
          expect((await claimLockRegister(tx, short)).status).toBe('claimed');
          bounded(await boundMs(tx));
        });
        await short.release();
        await long.release();
      } finally {
        await m.close();
      }
    });
  });

  it("a fenced transaction's writes under its own lease send no statement beyond them; another lease's, one", async () => {
    await withScenario(3, async (url) => {
      const m = await openManager({ kind: 'postgres', namespace: uniqueNamespace('count'), databaseUrl: url });
      const sent: string[] = [];
      const client = postgres(url, {
        max: 2,
        fetch_types: false,
        onnotice: () => {},
        debug: (_c: number, query: string) => sent.push(query),
      });
      const db = drizzle(client) as unknown as Database;
      try {
        const own = await m.manager.acquire('A', { ttlMs: 60_000 });
        const other = await m.manager.acquire('B', { ttlMs: 60_000 });
        const repo = fencedRepository(db, resource);
        const bounds = () => sent.filter((q) => q.includes('idle_in_transaction_session_timeout')).length;
        sent.length = 0;
        const mine = await fencedTransaction(db, own, async () => {
          for (const id of [1, 2]) await repo.with(own).update({ id }, { value: 'own lease' });
        });
        expect(mine.status).toBe('applied');
        // begin, the claim (which bounds the transaction), two updates, commit.
        expect([sent.length, bounds()]).toEqual([5, 1]);
        sent.length = 0;
        const theirs = await fencedTransaction(db, own, async () => {
          await repo.with(other).update({ id: 3 }, { value: 'another lease' });
        });
        expect(theirs.status).toBe('applied');
        expect([sent.length, bounds()]).toEqual([5, 2]);
      } finally {
        await client.end();
        await m.close();
      }
    });
  });

  it('Promise.all of 16 lock-scoped writes under one lease all apply', async () => {
    await withScenario(16, async (url) => {
      const m = await openManager({ kind: 'postgres', namespace: uniqueNamespace('p16'), databaseUrl: url });
      try {
        const lease = await m.manager.acquire('L', { ttlMs: 60_000 });
        const leased = fencedRepository(m.db, resource).with(lease);
        const results = await Promise.all(
          Array.from({ length: 16 }, (_, i) =>
            leased.update({ id: i + 1 }, { value: `v${i}` }, { returning: 'status' }),
          ),
        );
        expect(results.map((r) => r.status)).toEqual(Array(16).fill('applied'));
        await lease.release();
      } finally {
        await m.close();
      }
    });
  });

  it('two processes running fenced transactions over two leases in opposite orders end without a hang', async () => {
    await withScenario(2, async (url) => {
      const config: ManagerConfig = { kind: 'postgres', namespace: uniqueNamespace('cross'), databaseUrl: url };
      const old = startWorker(WORKER, { ...config, ttlMs: 1_500 });
      const current = startWorker(WORKER, { ...config, ttlMs: 60_000 });
      try {
        await Promise.all([old, current].map((w) => w.next((m) => m.event === 'ready')));
        for (const lock of ['a', 'b']) {
          old.send({ cmd: 'acquire', lock });
          await old.next((m) => m.event === 'acquired' && m.lock === lock);
        }
        for (const lock of ['b', 'a']) {
          current.send({ cmd: 'acquire', lock });
          await current.next((m) => m.event === 'acquired' && m.lock === lock, 60_000);
        }
        old.send({ cmd: 'crossTransactions', locks: ['b', 'a'], ids: [2, 1], rounds: 20 });
        current.send({ cmd: 'crossTransactions', locks: ['a', 'b'], ids: [1, 2], rounds: 20 });
        const [o, c] = await Promise.all([old, current].map((w) => w.next((m) => m.event === 'crossed', 90_000)));
        const oldCounts = o?.counts as Record<string, number>;
        const currentCounts = c?.counts as Record<string, number>;
        expect(oldCounts.applied ?? 0, JSON.stringify(oldCounts)).toBe(0);
        expect(Object.keys(oldCounts).every((s) => s === 'stale' || s === 'retryable')).toBe(true);
        expect(
          Object.keys(currentCounts).every((s) => s === 'applied' || s === 'retryable'),
          JSON.stringify(currentCounts),
        ).toBe(true);
        expect(currentCounts.applied ?? 0).toBeGreaterThan(0);
      } finally {
        old.kill();
        current.kill();
      }
    });
  });

  it('a forged fence through with({ fence, signal, lock }) is refused; a bare-fence write on scope: lock is a typed error', async () => {
    await withScenario(2, async (url) => {
      const m = await openManager({ kind: 'postgres', namespace: uniqueNamespace('forge'), databaseUrl: url });
      try {
        const lease = await m.manager.acquire('L', { ttlMs: 60_000 });
        const repo = fencedRepository(m.db, resource, { scope: 'lock' });
        const forged = { fence: (lease.fence + 1_000n) as typeof lease.fence, signal: lease.signal, lock: lease.lock };
        await expect(repo.with(forged).update({ id: 1 }, { value: 'forged' })).rejects.toBeInstanceOf(
          FenceNotIssuedError,
        );
        await expect(repo.with(forged).upsert({ id: 3, value: 'forged' })).rejects.toBeInstanceOf(FenceNotIssuedError);
        await expect(fencedTransaction(m.db, forged, async () => 'never')).rejects.toMatchObject({
          code: 'fence_not_issued',
        });
        expect((await repo.get({ id: 1 }))?.value).toBe('initial');
        expect(await repo.get({ id: 3 })).toBeUndefined();
        // The real grant still writes, and bare fences are refused before any query.
        expect((await repo.with(lease).update({ id: 1 }, { value: 'real' })).status).toBe('applied');
        await expect(repo.update({ id: 2 }, lease.fence, { value: 'x' })).rejects.toBeInstanceOf(LockScopeError);
        expect(() => repo.with({ fence: lease.fence, signal: lease.signal })).toThrow(LockScopeError);
        await lease.release();
      } finally {
        await m.close();
      }
    });
  });
});

describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL'))(
  'the register reset (Redis: claimed lazily)',
  { timeout: 120_000 },
  () => {
    it('a forged huge fence wedges the lock until an operator resets the register with the CLI', async () => {
      await withScenario(2, async (url) => {
        const namespace = uniqueNamespace('reset');
        const m = await openManager({ kind: 'redis', namespace, databaseUrl: url, redisUrl: services.redis.url });
        try {
          const lease = await m.manager.acquire('L', { ttlMs: 60_000 });
          const lock = lease.lock;
          if (!lock) throw new Error('a Redis lease has a lock');
          const repo = fencedRepository(m.db, resource);
          const huge = (2n ** 62n) as typeof lease.fence;
          // Nothing can tell a Redis fence that was never issued: the forged claim lands and wedges the lock.
          expect(
            (await repo.with({ ...unaware(lease), fence: huge }).update({ id: 1 }, { value: 'forged' })).status,
          ).toBe('applied');
          expect(await repo.with(lease).update({ id: 2 }, { value: 'real' })).toEqual({
            status: 'stale',
            currentFence: huge,
          });
          const env = { DATABASE_URL: url };
          const listed = await runCli(['locks', 'registers', '--namespace', namespace, '--json'], env);
          expect(listed.code).toBe(0);
          expect(JSON.parse(listed.stdout)).toEqual([{ ...lock, fence: huge.toString() }]);
          const reset = await runCli(
            [
              'locks',
              'reset-register',
              '--kind',
              lock.kind,
              '--source',
              lock.source,
              '--namespace',
              namespace,
              '--name',
              'L',
              '--fence',
              lease.fence.toString(),
              '--json',
            ],
            env,
          );
          expect(reset.code).toBe(0);
          expect(JSON.parse(reset.stdout)).toMatchObject({ before: huge.toString(), after: lease.fence.toString() });
          expect((await repo.with(lease).update({ id: 2 }, { value: 'real' })).status).toBe('applied');
          const bad = await runCli(['locks', 'reset-register', '--kind', 'redis'], env);
          expect(bad.code).toBe(2);
          // The eager claim: a newer Redis lease claims at once, and an older holder is refused everywhere.
          const newer = await m.manager.acquire('L2', { ttlMs: 60_000 });
          const older = { ...unaware(newer), fence: (newer.fence - 1n) as typeof newer.fence };
          expect(await claimLockRegister(m.db, newer)).toEqual({ status: 'claimed' });
          expect(await claimLockRegister(m.db, older)).toEqual({ status: 'stale', currentFence: newer.fence });
          expect(await repo.with(older).update({ id: 1 }, { value: 'older' })).toEqual({
            status: 'stale',
            currentFence: newer.fence,
          });
          await newer.release();
          await lease.release();
        } finally {
          await m.close();
        }
      });
    });
  },
);

describe('lock scope on PGlite (the embedded default)', { timeout: 120_000 }, () => {
  /** A migrated PGlite and a Postgres lease manager on it, closed after `fn`. */
  async function onPglite(fn: (db: Database, locks: LockManager) => Promise<void>): Promise<void> {
    const test = await pgliteDatabase();
    const locks = postgresLockManager({ client: test.db, namespace: uniqueNamespace('pglite'), listen: false });
    try {
      await migrate(test.db);
      await fn(test.db, locks);
    } finally {
      await locks.close();
      await test.close();
    }
  }

  it('the Postgres lease backend claims at grant: the old holder is refused on a row the new one never wrote', () =>
    onPglite(async (db, locks) => {
      await db.execute(
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await db.execute(sql`insert into resource (id, value) values (1, 'initial'), (2, 'initial')`);
      const repo = fencedRepository(db, resource, { scope: 'lock' });
      const old = await locks.acquire('L', { ttlMs: 100, autoExtend: false });
      expect((await repo.with(unaware(old)).update({ id: 1 }, { value: 'old' })).status).toBe('applied');
      const current = await locks.acquire('L', { ttlMs: 60_000, waitMs: 10_000 });
      // The grant alone refuses the old holder, before the new one writes anything.
      expect(await repo.with(unaware(old)).update({ id: 2 }, { value: 'late' })).toEqual({
        status: 'stale',
        currentFence: current.fence,
      });
      const result = await fencedTransaction(db, current, async () => {
        await repo.with(current).update({ id: 1 }, { value: 'new 1' });
        await repo.with(current).update({ id: 2 }, { value: 'new 2' });
        return 'done';
      });
      expect(result).toEqual({ status: 'applied', value: 'done' });
      const refused = await fencedTransaction(db, unaware(old), async () => 'never');
      expect(refused.status).toBe('stale');
      expect((await repo.get({ id: 2 }))?.value).toBe('new 2');
      await current.release();
    }));

  // palisade bounded a lock-scoped transaction's idle time on PGlite too: once the timeout fired there, the
  // next statement spun the process at full CPU forever (an attack, every time; PGlite alone does it too).
  // In a child process, killed if it does not exit: a spinning event loop would stop this suite's timers.
  it('lock-scoped work that sits idle past its lease inside a transaction settles, and PGlite answers after', () => {
    const out = execFileSync(process.execPath, ['--import', 'tsx', 'test/fixtures/pglite-idle-past-ttl.ts'], {
      encoding: 'utf8',
      timeout: 90_000,
    });
    expect(
      out
        .trim()
        .split('\n')
        .map((line) => JSON.parse(line)),
    ).toEqual([
      // Its lease ran out before the COMMIT: refused, nothing written.
      { case: 'fenced transaction', settled: 'rejected', code: 'lease_lost', alive: true },
      // Yours commits: on PGlite nothing else could take the lock while it was open.
      { case: 'your own transaction', settled: 'applied', alive: true },
    ]);
  });

  // What the test above relies on, read directly, and behind pglite-socket too (one engine: its version() names it).
  it('on PGlite, in process or behind pglite-socket, a lock-scoped write in a transaction sets no idle bound', async () => {
    const lite = newPglite();
    const db = drizzlePglite(lite) as unknown as Database;
    const locks = postgresLockManager({ client: db, namespace: uniqueNamespace('pglite'), listen: false });
    let server: PGLiteSocketServer | undefined;
    let viaSocket: postgres.Sql | undefined;
    try {
      await migrate(db);
      await execute(
        db,
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await execute(db, sql`insert into resource (id, value) values (1, 'initial'), (2, 'initial')`);
      const lease = await locks.acquire('L', { ttlMs: 60_000 });
      const boundAfterWrite = (on: Database, id: number) =>
        transaction(on, async (tx) => {
          const { status } = await fencedRepository(tx, resource).with(lease).update({ id }, { value: 'x' });
          const [row] = await execute(tx, sql`select current_setting('idle_in_transaction_session_timeout') as v`);
          return { status, bound: String(row?.v) };
        });
      expect(await boundAfterWrite(db, 1)).toEqual({ status: 'applied', bound: '0' });
      server = new PGLiteSocketServer({ db: lite, port: 0, host: '127.0.0.1' });
      await server.start();
      viaSocket = postgres(`postgres://postgres@${server.getServerConn()}/postgres`, { max: 1, onnotice: () => {} });
      expect(await boundAfterWrite(drizzle(viaSocket) as unknown as Database, 2)).toEqual({
        status: 'applied',
        bound: '0',
      });
      await lease.release();
    } finally {
      await viaSocket?.end({ timeout: 5 });
      await server?.stop();
      await locks.close();
      await lite.close();
    }
  });

  // PGlite returns text without a leading U+FEFF: a claim's rows name their locks by key, a uuid.
  it('a fenced transaction over two leases is refused when a higher fence claimed a lock whose name begins with U+FEFF', () =>
    onPglite(async (db, locks) => {
      await db.execute(sql`create table ledger (id serial primary key, note text)`);
      const name = '\uFEFFA';
      const stale = await locks.acquire(name, { ttlMs: 100, autoExtend: false });
      const held = await locks.acquire('B', { ttlMs: 60_000, autoExtend: false });
      const newer = await locks.acquire(name, { ttlMs: 60_000, waitMs: 10_000 }); // once the stale one ran out
      const result = await fencedTransaction(db, [unaware(stale), unaware(held)], async (tx) => {
        await tx.execute(sql`insert into ledger (note) values ('stale')`);
        return 'ran';
      });
      expect(result).toMatchObject({ status: 'stale', refusal: { table: null, currentFence: newer.fence } });
      expect(await db.execute(sql`select * from ledger`)).toMatchObject({ rows: [] });
      await Promise.all([newer.release(), held.release()]);
    }));
});

describe("the caller's own error, thrown inside palisade's transactions", () => {
  // Regression (outside review): the transaction a lock-scoped modify or a fenced transaction
  // claims in turned the function's error into a DatabaseError naming no cause.
  it('comes out of a lock-scoped modify and of fencedTransaction as it was thrown, and nothing is written', async () => {
    const test = await pgliteDatabase();
    try {
      await migrate(test.db);
      await test.db.execute(
        sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
      );
      await test.db.execute(sql`insert into resource (id, value) values (1, 'initial')`);
      const repo = fencedRepository(test.db, resource, { scope: 'lock' });
      const holder = {
        fence: 7n as Fence,
        lock: Object.freeze({ kind: 'test', source: 'caller-error', namespace: '', name: 'L' }),
        signal: new AbortController().signal,
      };
      class InsufficientFunds extends Error {}
      for (const thrown of [new InsufficientFunds('balance too low'), 'a plain string']) {
        const modified = repo.with(holder).modify({ id: 1 }, () => {
          throw thrown;
        });
        await expect(modified).rejects.toBe(thrown);
        const transacted = fencedTransaction(test.db, holder, async (tx) => {
          await fencedRepository(tx, resource).update({ id: 1 }, holder.fence, { value: 'written, then rolled back' });
          throw thrown;
        });
        await expect(transacted).rejects.toBe(thrown);
        // Through both at once: a lock-scoped modify inside a fenced transaction.
        const nested = fencedTransaction(test.db, holder, () =>
          repo.with(holder).modify({ id: 1 }, () => {
            throw thrown;
          }),
        );
        await expect(nested).rejects.toBe(thrown);
      }
      expect((await repo.get({ id: 1 }))?.value).toBe('initial');
    } finally {
      await test.close();
    }
  });
});

describe.each(everyTransactionDriver.filter((d) => !d.real || needs('DATABASE_URL')))(
  'an updateWhere that leaves rows stale inside a fenced transaction, on $name',
  ({ open }) => {
    // Regression (an attack): a batch's stale rows never reached the transaction, which committed the rest.
    const holderOf = (name: string, fence: bigint) => ({
      fence: fence as Fence,
      lock: Object.freeze({ kind: 'test', source: 'stale-batch', namespace: uniqueNamespace(), name }),
      signal: new AbortController().signal,
    });

    it('rolls the whole transaction back and reports the refusal: row-scoped, lock-scoped, and a retry of its own fence', async () => {
      const test = await open({ migrated: true });
      try {
        const { db } = test;
        await db.execute(
          sql`create table resource (id int primary key, value text, last_fence bigint not null default 0, deleted_at timestamptz)`,
        );
        await db.execute(sql`insert into resource (id, value) values (1, 'initial'), (2, 'initial'), (3, 'initial')`);
        const repo = fencedRepository(db, resource);
        const valueAt = async (id: number) => (await repo.get({ id }))?.value;
        expect((await repo.update({ id: 2 }, 100n as Fence, { value: 'newer' })).status).toBe('applied');
        const a = holderOf('A', 50n);
        for (const allOrNothing of [false, true]) {
          const result = await fencedTransaction(db, a, async () => {
            await repo.with(a).update({ id: 3 }, { value: 'rolled back' });
            return repo.with(a).updateWhere(sql`id in (1, 2)`, { value: 'late' }, { allOrNothing });
          });
          expect([allOrNothing, result]).toEqual([
            allOrNothing,
            {
              status: 'stale',
              refusal: { status: 'stale', table: 'resource', key: null, attemptedFence: 50n, currentFence: 100n },
            },
          ]);
          expect([await valueAt(1), await valueAt(2), await valueAt(3)]).toEqual(['initial', 'newer', 'initial']);
        }
        // A lock whose register a higher fence claimed: refused on every row, even where the condition matches none.
        const b = holderOf('B', 60n);
        const staleB = { ...b, fence: 55n as Fence };
        expect(await claimLockRegister(db, b)).toEqual({ status: 'claimed' });
        for (const where of [sql`id = 1`, sql`id = 99`]) {
          const result = await fencedTransaction(db, a, async () => {
            await repo.with(a).update({ id: 3 }, { value: 'rolled back' });
            return repo.with(staleB).updateWhere(where, { value: 'late' });
          });
          expect(result).toEqual({
            status: 'stale',
            refusal: { status: 'stale', table: 'resource', key: null, attemptedFence: 55n, currentFence: 60n },
          });
        }
        await expect(
          fencedTransactionOrThrow(db, a, () => repo.with(staleB).updateWhere(sql`id = 1`, { value: 'late' })),
        ).rejects.toBeInstanceOf(StaleFenceError);
        expect([await valueAt(1), await valueAt(3)]).toEqual(['initial', 'initial']);
        // Rows this very fence wrote (a retry after a commit it did not hear of): duplicate, as a single write.
        const done = await fencedTransaction(db, a, () =>
          repo.with(a).updateWhere(sql`id in (1, 3)`, { value: 'credited' }),
        );
        expect(done).toEqual({ status: 'applied', value: { applied: 2, stale: 0 } });
        const again = await fencedTransaction(db, a, () =>
          repo.with(a).updateWhere(sql`id in (1, 3)`, { value: 'credited twice' }),
        );
        expect(again).toEqual({
          status: 'duplicate',
          refusal: { status: 'duplicate', table: 'resource', key: null, attemptedFence: 50n, currentFence: 50n },
        });
        // Outside a fenced transaction a batch still applies what it may and counts the rest.
        expect(await repo.with(holderOf('C', 70n)).updateWhere(sql`id in (1, 2)`, { value: 'c' })).toEqual({
          applied: 1,
          stale: 1,
        });
        expect([await valueAt(1), await valueAt(2), await valueAt(3)]).toEqual(['c', 'newer', 'credited']);
      } finally {
        await test.close();
      }
    });
  },
);
