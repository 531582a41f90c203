/**
 * The seed's scenarios with the Redis lock manager, each holder a separate
 * OS process (test/workers/lock-worker.ts) that the test kills with
 * SIGKILL, pauses with SIGSTOP and resumes with SIGCONT. Real Redis
 * (REDIS_URL), real Postgres (DATABASE_URL).
 */
import { sql } from 'drizzle-orm';
import { afterEach, describe, expect, it } from 'vitest';
import { execute } from '../../src/driver.js';
import { killAllWorkers, type Message, startWorker, type Worker } from '../support/processes.js';
import { redisScenario } from '../support/redis.js';
import { needs } from '../support/services.js';

const REDIS_URL = process.env.REDIS_URL ?? '';
const WORKER = 'test/workers/lock-worker.ts';

const is = (event: string) => (m: Message) => m.event === event;

async function ready(args: Record<string, unknown>): Promise<Worker> {
  const worker = startWorker(WORKER, args);
  await worker.next(is('ready'));
  return worker;
}

/** Sends `cmd` and waits for the worker's answer: the first new message with one of `events`. */
async function ask(worker: Worker, command: Record<string, unknown>, ...events: string[]): Promise<Message> {
  const from = worker.messages.length;
  worker.send(command);
  return worker.next((m) => worker.messages.indexOf(m) >= from && events.includes(m.event));
}

describe.runIf(needs('REDIS_URL') && needs('DATABASE_URL'))('redis lock manager across processes', () => {
  afterEach(killAllWorkers);

  it('seed 2: a holder killed with SIGKILL does not wedge the lock: another process acquires it', async () => {
    const s = await redisScenario(REDIS_URL);
    const holder = await ready(s.worker('nightly', { ttlMs: 1_000 }));
    const granted = await ask(holder, { cmd: 'acquire' }, 'acquired', 'unavailable');
    expect(granted.event).toBe('acquired');
    holder.send({ cmd: 'hold', ms: 30_000 });
    holder.kill();
    await holder.exited;

    const next = await s.manager.acquire('nightly', { ttlMs: 5_000, waitMs: 10_000 });
    expect(next.fence).toBeGreaterThan(BigInt(String(granted.fence)));
    await next.release();
  });

  it("seeds 5 and 6: a holder paused past its TTL writes stale; the row keeps the next holder's value", async () => {
    const s = await redisScenario(REDIS_URL);
    const a = await ready(s.worker('account', { ttlMs: 500, holder: 'A' }));
    const b = await ready(s.worker('account', { ttlMs: 30_000, waitMs: 10_000, holder: 'B' }));

    const aGrant = await ask(a, { cmd: 'acquire' }, 'acquired', 'unavailable');
    expect(aGrant.event).toBe('acquired');
    a.pause(); // a stop-the-world pause, longer than the TTL
    const bGrant = await ask(b, { cmd: 'acquire' }, 'acquired', 'unavailable');
    expect(bGrant.event).toBe('acquired');
    expect(BigInt(String(bGrant.fence))).toBeGreaterThan(BigInt(String(aGrant.fence)));
    expect((await ask(b, { cmd: 'write', value: 'written by B' }, 'write', 'error')).status).toBe('applied');

    a.resume(); // A never learned it lost the lock, and writes
    const aWrite = await ask(a, { cmd: 'write', value: 'written by A' }, 'write', 'error');
    expect(aWrite.status).toBe('stale');
    expect(aWrite.currentFence).toBe(String(bGrant.fence));
    const [row] = await execute(s.test.db, sql`select value, last_fence from resource where id = 1`);
    expect(row?.value).toBe('written by B');
    expect(String(row?.last_fence)).toBe(String(bGrant.fence));
  });

  it('seed 7: the watchdog keeps a short TTL alive through a job several TTLs long; SIGKILL frees the lock', async () => {
    const s = await redisScenario(REDIS_URL);
    const job = await ready(s.worker('rebuild-index', { ttlMs: 900, autoExtend: true, holder: 'rebuilder' }));
    const grant = await ask(job, { cmd: 'acquire' }, 'acquired', 'unavailable');
    expect(grant.event).toBe('acquired');

    await ask(job, { cmd: 'hold', ms: 3_000 }, 'held'); // over three TTLs of work
    expect(job.messages.filter(is('lost'))).toEqual([]);
    const info = await s.manager.inspect('rebuild-index');
    expect(info?.holder).toBe('rebuilder');
    expect(info?.fence).toBe(BigInt(String(grant.fence)));
    expect(await s.manager.tryAcquire('rebuild-index', { ttlMs: 5_000 })).toBeNull(); // an admin's click: fast "busy"

    job.kill(); // the watchdog dies with it
    await job.exited;
    const next = await s.manager.acquire('rebuild-index', { ttlMs: 5_000, waitMs: 10_000 });
    expect(next.fence).toBeGreaterThan(BigInt(String(grant.fence)));
    await next.release();
  });

  it('acquireAll in opposite orders from two processes never deadlocks', async () => {
    const s = await redisScenario(REDIS_URL);
    const [one, two] = await Promise.all(
      [1, 2].map(() => ready(s.worker('unused', { ttlMs: 10_000, waitMs: 20_000 }))),
    );
    const done = await Promise.all([
      ask(one as Worker, { cmd: 'acquireAll', names: ['from', 'to'], rounds: 15 }, 'acquiredAll', 'error'),
      ask(two as Worker, { cmd: 'acquireAll', names: ['to', 'from'], rounds: 15 }, 'acquiredAll', 'error'),
    ]);
    expect(done.map((m) => m.event)).toEqual(['acquiredAll', 'acquiredAll']);
    expect(await s.manager.inspect('from')).toBeNull();
    expect(await s.manager.inspect('to')).toBeNull();
  });
});
