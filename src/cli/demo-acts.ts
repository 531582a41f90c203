/**
 * The two acts of `palisade demo` (the README's "What `npm run demo`
 * shows"): the same paused-worker story with a TTL lock alone, then with
 * palisade's fences.
 */
import { performance } from 'node:perf_hooks';
import { sql } from 'drizzle-orm';
import { type Database, execute, int8 } from '../driver.js';
import { CliError } from '../errors.js';
import type { Io } from './common.js';
import { type DemoWorker, STEP_TIMEOUT_MS } from './demo-workers.js';

/** Prints the story with the time since the act began. */
class Timeline {
  #start = performance.now();
  constructor(private readonly io: Io) {}

  restart(): void {
    this.#start = performance.now();
  }

  say(who: string, text: string): void {
    const t = ((performance.now() - this.#start) / 1000).toFixed(2).padStart(5);
    this.io.out(`  ${t}s  ${who.padEnd(2)} ${text}`);
  }
}

async function readCounter(db: Database, row: number): Promise<{ visits: number; fence: bigint }> {
  const [r] = await execute(db, sql`select visits, last_fence from palisade_demo_counter where id = ${row}`);
  if (!r) throw new CliError(`counter row ${row} is missing`);
  return { visits: Number(r.visits), fence: int8(r.last_fence) ?? 0n };
}

export async function actOne(io: Io, db: Database, a: DemoWorker, b: DemoWorker): Promise<{ visits: number }> {
  io.out('Act 1 — a correct TTL lock (unique token, SET NX with a TTL, token-checked release), no fence');
  const t = new Timeline(io);
  const row = 1;
  const got = await a.call('naive-acquire', { waitMs: 0 });
  if (got.acquired !== true) throw new CliError('worker A could not take the naive lock');
  t.say('A', 'took the lock "counter"');
  const aRead = Number((await a.call('read', { row })).visits);
  t.say('A', `read visits = ${aRead}; will write ${aRead + 1}`);
  a.pause();
  const pausedAt = performance.now();
  t.say('⏸', `A paused (SIGSTOP) — a GC pause, a throttled CPU, a slow disk…`);
  const bGot = await b.call('naive-acquire', { waitMs: STEP_TIMEOUT_MS - 5000 });
  if (bGot.acquired !== true) throw new CliError("worker B could not take the naive lock after A's lease expired");
  t.say('B', 'took the lock "counter": A\'s lease had expired while A was paused');
  const bRead = Number((await b.call('read', { row })).visits);
  await b.call('naive-write', { row, visits: bRead + 1 });
  t.say('B', `read visits = ${bRead}, wrote visits = ${bRead + 1}`);
  await b.call('naive-release');
  t.say('B', 'released the lock');
  a.resume();
  t.say(
    '▶',
    `A resumed (SIGCONT) after ${((performance.now() - pausedAt) / 1000).toFixed(1)} s; it still believes it holds the lock`,
  );
  const wrote = await a.call('naive-write', { row, visits: aRead + 1 });
  t.say(
    'A',
    `wrote visits = ${aRead + 1} — ${Number(wrote.rows) === 1 ? 'it landed: nothing checked that A still held the lock' : 'it did not land'}`,
  );
  const released = await a.call('naive-release');
  t.say(
    'A',
    released.released === true
      ? 'released the lock'
      : "release found the lock gone (the token check kept A from deleting another's lock) — but the write already landed",
  );
  const final = await readCounter(db, row);
  io.out(
    `  result: visits = ${final.visits} after two increments — expected 2${final.visits === 2 ? '' : ". B's increment was lost."}\n`,
  );
  return { visits: final.visits };
}

export async function actTwo(
  io: Io,
  db: Database,
  a: DemoWorker,
  b: DemoWorker,
): Promise<{ visits: number; ok: boolean; staleFence: string; winningFence: string }> {
  io.out('Act 2 — palisade: every lease carries a fence, every write is fenced');
  const t = new Timeline(io);
  const row = 2;
  const aFence = String((await a.call('acquire', { waitMs: 10_000 })).fence);
  t.say('A', `took the lock "counter" with fence ${aFence} (watchdog on: it extends the lease while A runs)`);
  const aRead = Number((await a.call('read', { row })).visits);
  t.say('A', `read visits = ${aRead}; will write ${aRead + 1}`);
  a.pause();
  const pausedAt = performance.now();
  t.say('⏸', 'A paused (SIGSTOP) — a paused process cannot run its watchdog either');
  const bFence = String((await b.call('acquire', { waitMs: STEP_TIMEOUT_MS - 5000 })).fence);
  t.say('B', `took the lock "counter" with fence ${bFence}: A's lease had expired`);
  const bRead = Number((await b.call('read', { row })).visits);
  const bWrite = await b.call('fenced-write', { row, visits: bRead + 1 });
  t.say('B', `read visits = ${bRead}, wrote visits = ${bRead + 1} with fence ${bFence}: ${String(bWrite.status)}`);
  await b.call('release');
  t.say('B', 'released the lock');
  a.resume();
  t.say('▶', `A resumed (SIGCONT) after ${((performance.now() - pausedAt) / 1000).toFixed(1)} s`);
  const aWrite = await a.call('fenced-write', { row, visits: aRead + 1 });
  const refused = aWrite.status === 'stale';
  t.say(
    'A',
    refused
      ? `wrote visits = ${aRead + 1} with fence ${aFence} — REFUSED by Postgres: stale (the row carries fence ${String(aWrite.currentFence)})`
      : `wrote visits = ${aRead + 1} with fence ${aFence}: ${String(aWrite.status)}`,
  );
  const state = await a.call('lease-state');
  if (state.lost === true) t.say('A', "its lease's signal has fired too: it knows it lost the lock");
  await a.call('release');
  const retryFence = String((await a.call('acquire', { waitMs: 10_000 })).fence);
  const inc = await a.call('increment', { row });
  t.say('A', `took the lock again with fence ${retryFence}; safe read-modify-write → visits = ${String(inc.visits)}`);
  await a.call('release');
  t.say('A', 'released the lock');
  const final = await readCounter(db, row);
  const ok = refused && final.visits === 2 && String(final.fence) === retryFence;
  io.out(
    `  result: visits = ${final.visits} after two increments — ${final.visits === 2 ? 'right' : 'WRONG'}; the row's fence is ${final.fence}; the stale write never landed`,
  );
  return { visits: final.visits, ok, staleFence: aFence, winningFence: bFence };
}
