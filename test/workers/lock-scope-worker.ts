/**
 * A lock-scoped holder in its own OS process (test/repo/lock-scope.test.ts),
 * driven by JSON lines on stdin, reporting JSON lines on stdout.
 * argv[2]: JSON ManagerConfig & { ttlMs, waitMs }.
 */
import { performance } from 'node:perf_hooks';
import { createInterface } from 'node:readline';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import type { Lease } from '../../src/fencing/lease.js';
import { fencedTransaction, type TransactionLease } from '../../src/repo/fenced-transaction.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { type ManagerConfig, openManager } from '../support/managers.js';

const resource = pgTable('resource', { id: integer('id').primaryKey(), value: text('value'), ...fenceColumns() });

const args = JSON.parse(process.argv[2] ?? '{}') as ManagerConfig & { ttlMs: number; waitMs?: number };
const say = (event: string, data: Record<string, unknown> = {}) =>
  process.stdout.write(
    `${JSON.stringify({ event, pid: process.pid, ...data }, (_k, v) => (typeof v === 'bigint' ? v.toString() : v))}\n`,
  );

const { manager, db, close } = await openManager(args);
const repo = fencedRepository(db, resource);
// Several transactions of one grant write the same rows: `<=`, as the README says for that case.
const again = fencedRepository(db, resource, { sameFence: 'allow' });
const leases = new Map<string, Lease>();
const options = { ttlMs: args.ttlMs, waitMs: args.waitMs ?? 20_000, autoExtend: false };

// A holder that does not know it lost the lease: its own signal never fires (a paused process
// wakes up believing it still holds the lock), so only the database can refuse it.
const unaware = (lease: Lease): TransactionLease => ({
  fence: lease.fence,
  lock: lease.lock,
  signal: new AbortController().signal,
  expiresAt: performance.now() + 30_000,
});

const leaseOf = (name: unknown): Lease => {
  const lease = leases.get(String(name));
  if (!lease) throw new Error(`no lease for ${String(name)}`);
  return lease;
};

const commands: Record<string, (c: Record<string, unknown>) => Promise<void>> = {
  async acquire(c) {
    const lease = await manager.acquire(String(c.lock), options);
    leases.set(lease.name, lease);
    say('acquired', { lock: lease.name, fence: lease.fence });
  },
  async write(c) {
    // Lock-scoped: through with(lease).
    const result = await repo.with(unaware(leaseOf(c.lock))).update({ id: Number(c.id) }, { value: String(c.value) });
    say('write', { id: c.id, status: result.status });
  },
  async pausedTransaction(c) {
    // Writes row `id` in a fenced transaction, says so, then idles inside it (the parent SIGSTOPs us there).
    const lease = leaseOf(c.lock);
    try {
      const result = await fencedTransaction(db, lease, async (tx) => {
        const written = await repo.with(lease).update({ id: Number(c.id) }, { value: String(c.value) });
        await tx.execute(sql`select 1`);
        say('inside', { status: written.status });
        await new Promise((resolve) => setTimeout(resolve, Number(c.idleMs ?? 3_000)));
        return written.status;
      });
      say('transaction', { status: result.status });
    } catch (err) {
      say('transaction', { status: 'error', code: (err as { code?: unknown }).code ?? null });
    }
  },
  async pausedAtDescribe(c) {
    // A fenced transaction whose second statement is new on its connection: postgres.js first sends it
    // described (Parse, Describe, Flush) and binds it only once the description is back. The parent
    // SIGSTOPs us in between (test/repo/lock-scope.test.ts).
    const lease = leaseOf(c.lock);
    try {
      const result = await fencedTransaction(db, lease, async (tx) => {
        const written = await repo.with(lease).update({ id: Number(c.id) }, { value: String(c.value) });
        await tx.execute(sql`select ${Number(c.id)}::int as palisade_describe_window`);
        return written.status;
      });
      say('transaction', { status: result.status });
    } catch (err) {
      say('transaction', { status: 'error', code: (err as { code?: unknown }).code ?? null });
    }
  },
  async pausedModifyInTransaction(c) {
    // A lock-scoped modify of row `id` inside a fenced transaction bounded by `txIdleMs`, for a holder
    // without an expiry estimate (its own bound would be 60 s); says so, then idles (SIGSTOPped there).
    const { fence, lock } = leaseOf(c.lock);
    const holder = { fence, lock, signal: new AbortController().signal };
    try {
      const result = await fencedTransaction(
        db,
        holder,
        async () => {
          const written = await repo.with(holder).modify({ id: Number(c.id) }, () => ({ value: String(c.value) }));
          say('inside', { status: written.status });
          await new Promise((resolve) => setTimeout(resolve, Number(c.idleMs ?? 3_000)));
          return written.status;
        },
        { idleTimeoutMs: Number(c.txIdleMs) },
      );
      say('transaction', { status: result.status });
    } catch (err) {
      say('transaction', { status: 'error', code: (err as { code?: unknown }).code ?? null });
    }
  },
  async pausedModify(c) {
    // A lock-scoped modify of row `id` whose function says so, then idles (the parent SIGSTOPs us there).
    const lease = leaseOf(c.lock);
    try {
      const result = await repo.with(lease).modify({ id: Number(c.id) }, async () => {
        say('inside', { status: 'claimed' });
        await new Promise((resolve) => setTimeout(resolve, Number(c.idleMs ?? 3_000)));
        return { value: String(c.value) };
      });
      say('modify', { status: result.status });
    } catch (err) {
      say('modify', { status: 'error', code: (err as { code?: unknown }).code ?? null });
    }
  },
  async crossTransactions(c) {
    // `rounds` fenced transactions over the given leases (in the order given), each writing rows in `ids` order.
    const names = c.locks as string[];
    const ids = c.ids as number[];
    const counts: Record<string, number> = {};
    for (let i = 0; i < Number(c.rounds ?? 10); i++) {
      let status: string;
      try {
        const held = names.map((n) => unaware(leaseOf(n)));
        const result = await fencedTransaction(db, held, async () => {
          for (const id of ids) {
            await again.with(held[0] as TransactionLease).update({ id }, { value: `pid ${process.pid} round ${i}` });
            await new Promise((resolve) => setTimeout(resolve, 2));
          }
        });
        status = result.status;
      } catch (err) {
        status = String((err as { code?: unknown }).code ?? 'error');
      }
      counts[status] = (counts[status] ?? 0) + 1;
    }
    say('crossed', { counts });
  },
  async exit() {
    await close();
    process.exit(0);
  },
};

say('ready');
for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  const command = JSON.parse(line) as Record<string, unknown>;
  try {
    await commands[String(command.cmd)]?.(command);
  } catch (err) {
    say('error', { message: err instanceof Error ? err.message : String(err) });
  }
}
