/**
 * A lock holder in its own OS process, driven by the parent over stdin (one
 * JSON command a line) and reporting on stdout (one JSON message a line).
 * argv[2]: JSON { kind, namespace, databaseUrl, redisUrl, lock, ttlMs, waitMs, autoExtend, holder }.
 */
import { createInterface } from 'node:readline';
import { sql } from 'drizzle-orm';
import { integer, pgTable, text } from 'drizzle-orm/pg-core';
import { runIfLeader } from '../../src/fencing/backends/postgres-advisory/leader.js';
import type { Lease } from '../../src/fencing/lease.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { fenceColumns } from '../../src/schema/fence-columns.js';
import { type ManagerConfig, openManager } from '../support/managers.js';

/** The row the writers fight over; the parent creates it. */
export const resource = pgTable('resource', {
  id: integer('id').primaryKey(),
  value: text('value'),
  ...fenceColumns(),
});
export const occupancy = pgTable('occupancy', { id: integer('id').primaryKey(), inside: integer('inside').notNull() });

const args = JSON.parse(process.argv[2] ?? '{}') as ManagerConfig & {
  lock: string;
  ttlMs: number;
  waitMs?: number;
  autoExtend?: boolean;
  holder?: string;
};
const say = (event: string, data: Record<string, unknown> = {}) =>
  process.stdout.write(
    `${JSON.stringify({ event, pid: process.pid, ...data }, (_k, v) => (typeof v === 'bigint' ? v.toString() : v))}\n`,
  );

const { manager, db, close } = await openManager(args);
const repo = fencedRepository(db, resource);
const options = {
  ttlMs: args.ttlMs,
  waitMs: args.waitMs ?? 10_000,
  autoExtend: args.autoExtend ?? false,
  holder: args.holder ?? `pid ${process.pid}`,
};
let lease: Lease | undefined;
let stopRequested = false;

// Gates a background job waits on until the parent sends `open` (or 60 s pass: nothing waits forever).
const gates = new Map<string, { promise: Promise<void>; open: () => void }>();
const gateOf = (name: string) => {
  let gate = gates.get(name);
  if (!gate) {
    let open = () => {};
    const promise = new Promise<void>((resolve) => {
      const timer = setTimeout(resolve, 60_000);
      open = () => {
        clearTimeout(timer);
        resolve();
      };
    });
    gate = { promise, open };
    gates.set(name, gate);
  }
  return gate;
};

const commands: Record<string, (c: Record<string, unknown>) => Promise<void>> = {
  async acquire() {
    try {
      lease = await manager.acquire(args.lock, options);
      lease.signal.addEventListener('abort', () => say('lost', { reason: String(lease?.signal.reason) }));
      say('acquired', { fence: lease.fence });
    } catch (err) {
      say('unavailable', { code: (err as { code?: string }).code });
    }
  },
  async write(c) {
    if (!lease) throw new Error('write before acquire');
    // Straight to the database with the lease's fence: the database, not the lease, decides.
    const result = await repo.update({ id: 1 }, lease.fence, { value: String(c.value) });
    say('write', { status: result.status, currentFence: result.status === 'stale' ? result.currentFence : null });
  },
  async release() {
    if (!lease) throw new Error('release before acquire');
    say('released', { result: await lease.release() });
  },
  async using(c) {
    // Mutual exclusion, observed by the database: `inside` must never exceed 1.
    let maxInside = 0;
    const rounds = Number(c.rounds ?? 5);
    for (let i = 0; i < rounds; i++) {
      await manager.using(args.lock, options, async () => {
        const [row] = await db
          .update(occupancy)
          .set({ inside: sql`${occupancy.inside} + 1` })
          .where(sql`${occupancy.id} = 1`)
          .returning();
        maxInside = Math.max(maxInside, row?.inside ?? 0);
        await new Promise((r) => setTimeout(r, Number(c.holdMs ?? 20)));
        await db
          .update(occupancy)
          .set({ inside: sql`${occupancy.inside} - 1` })
          .where(sql`${occupancy.id} = 1`);
      });
    }
    say('used', { rounds, maxInside });
  },
  async grants(c) {
    const fences: string[] = [];
    for (let i = 0; i < Number(c.count ?? 10); i++) {
      const l = await manager.acquire(args.lock, options);
      fences.push(l.fence.toString());
      await l.release();
    }
    say('grants', { fences });
  },
  async grantLoop(c) {
    // Grants (and releases) until `count` grants, `maxMs` or a `stop` command, whichever first, reporting each
    // fence as it comes; a failed attempt (e.g. the server restarting under us) is counted and retried shortly.
    const deadline = Date.now() + Number(c.maxMs ?? 10_000);
    const count = Number(c.count ?? 100);
    const lock = String(c.lock ?? args.lock);
    let granted = 0;
    let failures = 0;
    stopRequested = false;
    while (granted < count && Date.now() < deadline && !stopRequested) {
      try {
        const l = await manager.acquire(lock, options);
        say('grant', { fence: l.fence, i: granted++ });
        await l.release();
      } catch (err) {
        failures++;
        say('grantFailed', { message: err instanceof Error ? err.message : String(err) });
        await new Promise((r) => setTimeout(r, 20));
      }
    }
    say('grantLoopDone', { granted, failures });
  },
  async acquireAll(c) {
    // Takes all `names` (in the order given; the manager sorts them), holds them briefly, releases; `rounds` times.
    const names = (c.names as string[]) ?? [args.lock];
    const rounds = Number(c.rounds ?? 5);
    for (let i = 0; i < rounds; i++) {
      const leases = await manager.acquireAll(names, options);
      await new Promise((r) => setTimeout(r, Number(c.holdMs ?? 5)));
      await Promise.all(leases.map((l) => l.release()));
    }
    say('acquiredAll', { rounds });
  },
  async fencedGrants(c) {
    // `count` grants in a row, each writing the resource row with its fence while held. If fences follow the
    // order of grants across processes, every write applies; a fence below an earlier grant's comes back stale.
    const fences: string[] = [];
    const statuses: Record<string, number> = {};
    for (let i = 0; i < Number(c.count ?? 10); i++) {
      const l = await manager.acquire(args.lock, options);
      const result = await repo.update({ id: 1 }, l.fence, { value: `pid ${process.pid} #${i}` });
      statuses[result.status] = (statuses[result.status] ?? 0) + 1;
      fences.push(l.fence.toString());
      await l.release();
    }
    say('fencedGrants', { fences, statuses });
  },
  async leader(c) {
    // runIfLeader in the background, so the command loop stays free: the job says `running`, then waits for `open`.
    const gate = gateOf(String(c.gate ?? 'job'));
    const job = async (l: Lease) => {
      say('running', { fence: l.fence });
      await gate.promise;
      return `done by ${process.pid}`;
    };
    runIfLeader(manager, args.lock, job, options).then(
      (run) => say('leader', { ...run }),
      (err) => say('error', { message: err instanceof Error ? err.message : String(err) }),
    );
  },
  async open(c) {
    gateOf(String(c.gate ?? 'job')).open();
  },
  async stop() {
    // Seen (as a flag) while a loop runs; here, after it ended, nothing is left to stop.
    stopRequested = false;
  },
  async inspect() {
    say('inspect', { info: await manager.inspect(args.lock) });
  },
  async hold(c) {
    // Stay alive (bounded) so the parent can kill or pause us while we hold.
    await new Promise((r) => setTimeout(r, Number(c.ms ?? 30_000)));
    say('held');
  },
  async exit() {
    await close();
    process.exit(0);
  },
};

say('ready');
const queue = createInterface({ input: process.stdin });
// A `stop` line is seen at once, even while a long command (grantLoop) keeps the queue below waiting.
queue.on('line', (line) => {
  try {
    if ((JSON.parse(line) as { cmd?: unknown }).cmd === 'stop') stopRequested = true;
  } catch {
    // The command loop below reports the bad line.
  }
});
for await (const line of queue) {
  const command = JSON.parse(line) as Record<string, unknown>;
  const run = commands[String(command.cmd)];
  try {
    if (!run) throw new Error(`unknown command ${String(command.cmd)}`);
    await run(command);
  } catch (err) {
    say('error', { message: err instanceof Error ? err.message : String(err) });
  }
}
await close();
