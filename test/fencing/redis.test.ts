/**
 * The Redis lock manager, in one process, against the real Redis
 * (REDIS_URL) and the real Postgres (DATABASE_URL): grants, fences, token
 * checks, inspect, waiting, watchdog, validation, and the epoch protocol
 * that keeps fences above everything issued before.
 */
import { randomBytes } from 'node:crypto';
import { sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/postgres-js';
import postgres from 'postgres';
import { describe, expect, it, onTestFinished } from 'vitest';
import { execute } from '../../src/driver.js';
import {
  CommandTimeoutError,
  FenceSourceError,
  InvalidArgumentError,
  LeaseLostError,
  LockServiceError,
  LockUnavailableError,
} from '../../src/errors.js';
import {
  REDIS_COUNTER_BITS,
  REDIS_MAX_COUNTER,
  REDIS_QUEUE_STALE_MS,
  splitRedisFence,
} from '../../src/fencing/backends/redis/backend.js';
import { commandDeadline } from '../../src/fencing/backends/redis/command-deadline.js';
import { redisLockManager } from '../../src/fencing/backends/redis/manager.js';
import {
  BUMP_EPOCH_SCRIPT,
  INSTALL_EPOCH_SCRIPT,
  runBumpEpoch,
  runInstallEpoch,
} from '../../src/fencing/backends/redis/scripts/epoch.js';
import { REDIS_MIN_VERSION } from '../../src/fencing/backends/redis/scripts/identity.js';
import { RELEASE_SCRIPT } from '../../src/fencing/backends/redis/scripts/release.js';
import { scriptRunner } from '../../src/fencing/backends/redis/scripts/script.js';
import type { Lease } from '../../src/fencing/lease.js';
import { hashTag, namespaceKeys, pauseAfter, redisScenario } from '../support/redis.js';
import { startPrivateRedis } from '../support/redis-server.js';
import { expectStaleRefusedOnUntouchedRow } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { trackTimers } from '../support/timers.js';

const REDIS_URL = process.env.REDIS_URL ?? '';

/** Resolves when `signal` aborts (bounded by the test's timeout). */
function aborted(signal: AbortSignal): Promise<unknown> {
  return new Promise((resolve) => {
    if (signal.aborted) resolve(signal.reason);
    else signal.addEventListener('abort', () => resolve(signal.reason), { once: true });
  });
}

describe.runIf(needs('REDIS_URL') && needs('DATABASE_URL'))('redis lock manager', () => {
  it('grants a lease with a fence, and inspect shows holder, fence, grant time and TTL left', async () => {
    const { manager } = await redisScenario(REDIS_URL);
    const lease = await manager.acquire('report', { ttlMs: 30_000, holder: 'worker 1' });

    const info = await manager.inspect('report');
    expect(info).not.toBeNull();
    expect(info?.holder).toBe('worker 1');
    expect(info?.fence).toBe(lease.fence);
    expect(info?.acquiredAt).toBeInstanceOf(Date);
    expect(info?.remainingMs).toBeGreaterThan(0);
    expect(info?.remainingMs).toBeLessThanOrEqual(30_000);

    expect(await manager.tryAcquire('report', { ttlMs: 30_000 })).toBeNull();
    expect(await lease.release()).toBe('released');
    expect(await manager.inspect('report')).toBeNull();
    const next = await manager.tryAcquire('report', { ttlMs: 30_000 });
    expect(next?.fence).toBeGreaterThan(lease.fence);
    expect((await manager.inspect('report'))?.holder).toBeNull();
    await next?.release();
  });

  it('issues one increasing fence sequence per namespace, whatever the lock name', async () => {
    const { manager } = await redisScenario(REDIS_URL);
    const fences: bigint[] = [];
    for (const name of ['a', 'b', 'a', 'c', 'b']) {
      const lease = await manager.acquire(name, { ttlMs: 5_000 });
      fences.push(lease.fence);
      await lease.release();
    }
    expect(fences).toEqual([...fences].sort((x, y) => (x < y ? -1 : 1)));
    expect(new Set(fences).size).toBe(fences.length);
  });

  it('keeps a lock and its grant record in one key: holder labels of any text come back whole, and the record goes with the lock', async () => {
    const { manager, redis, namespace, keys } = await redisScenario(REDIS_URL);
    const labels = ['', '=', 'a=b:c', 'tab\there\r\nline ☃ 🔒', '\u0001\u00ff'];
    const leases: Lease[] = [];
    for (const [i, holder] of labels.entries()) {
      leases.push(await manager.acquire(`l${i}`, { ttlMs: 30_000, holder }));
    }
    leases.push(await manager.acquire('nobody', { ttlMs: 30_000 }));
    expect(await namespaceKeys(redis, namespace)).toEqual(
      [keys.fence, ...labels.map((_, i) => keys.lock(`l${i}`)), keys.lock('nobody')].sort(),
    );
    for (const [i, holder] of labels.entries()) {
      const info = await manager.inspect(`l${i}`);
      expect(info?.holder, JSON.stringify(holder)).toBe(holder);
      expect(info?.fence).toBe(leases[i]?.fence);
    }
    expect((await manager.inspect('nobody'))?.holder).toBeNull();
    for (const lease of leases) expect(await lease.release()).toBe('released');
    expect(await namespaceKeys(redis, namespace)).toEqual([keys.fence]);
  });

  it("refuses a token with NUL or a bad TTL and writes nothing; treats a lock set as a bare token (an older palisade's) as someone else's", async () => {
    const { manager, backend, redis, namespace, keys } = await redisScenario(REDIS_URL);
    const bare = backend();
    await expect(bare.grant('x', 'a\u0000b', 30_000, null)).rejects.toBeInstanceOf(InvalidArgumentError);
    expect(await namespaceKeys(redis, namespace)).toEqual([]);

    // A TTL Redis would refuse is refused before the script counts a fence for it.
    const warm = await manager.acquire('warm', { ttlMs: 1_000 });
    expect(await warm.release()).toBe('released');
    const counter = await redis.hget(keys.fence, 'counter');
    for (const ttl of [0, -1, 1.5]) {
      await expect(bare.grant('x', 'token', ttl, null)).rejects.toBeInstanceOf(InvalidArgumentError);
    }
    expect(await redis.hget(keys.fence, 'counter')).toBe(counter);
    expect(await redis.exists(keys.lock('x'))).toBe(0);

    // An older palisade kept the token alone in the lock key (its record in a second key).
    await redis.set(keys.lock('old'), 'older-token', 'PX', 30_000);
    expect(await manager.tryAcquire('old', { ttlMs: 1_000 })).toBeNull();
    expect(await bare.grant('old', 'older', 1_000, null)).toBeNull(); // its prefix is no match either
    expect(await bare.extend('old', 'older', 1_000)).toBe(false);
    expect(await bare.release('old', 'older')).toBe(false);
    const inspected = await manager.inspect('old').catch((err: unknown) => err);
    expect(inspected).toBeInstanceOf(FenceSourceError);
    expect(await redis.get(keys.lock('old'))).toBe('older-token');
    // Its owner's release (the same token check) frees it; then it is granted as usual.
    expect(await bare.release('old', 'older-token')).toBe(true);
    const lease = await manager.tryAcquire('old', { ttlMs: 30_000 });
    expect(lease).not.toBeNull();
    expect((await manager.inspect('old'))?.fence).toBe(lease?.fence);
    await lease?.release();
  });

  it('keeps lock names apart from each other and from the namespace keys, all in one hash slot', async () => {
    const { manager, redis, namespace, keys } = await redisScenario(REDIS_URL);
    const names = ['a', 'a}', '{a}', '}:lock:a', ':fence', 'fence', 'grant:a', 'lock:a', 'naïve ☃ 🔒', '{', '}'];
    const leases: Lease[] = [];
    for (const name of names) {
      const lease = await manager.tryAcquire(name, { ttlMs: 30_000 });
      expect(lease, name).not.toBeNull();
      if (lease) leases.push(lease);
    }
    const stored = await namespaceKeys(redis, namespace);
    expect(stored).toEqual([keys.fence, ...names.map((n) => keys.lock(n))].sort());
    for (const key of stored) expect(hashTag(key)).toBe(`palisade:${namespace}`);
    for (const lease of leases) expect((await manager.inspect(lease.name))?.fence).toBe(lease.fence);
    // The composed and decomposed spellings of one name are one lock.
    const composed = await manager.acquire('caf\u00e9', { ttlMs: 30_000 });
    expect(await manager.tryAcquire('cafe\u0301', { ttlMs: 30_000 })).toBeNull();
    for (const lease of [...leases, composed]) expect(await lease.release()).toBe('released');
  });

  it('returns fences above 2^53 exactly', async () => {
    const { manager, test, redis, keys } = await redisScenario(REDIS_URL);
    // This database's epoch sequence is far along: the first grant of the namespace takes the next epoch.
    await test.db.execute(sql`select setval('palisade.epoch_seq', ${2 ** 20})`);
    const lease = await manager.acquire('big', { ttlMs: 5_000 });

    const expected = ((2n ** 20n + 1n) << BigInt(REDIS_COUNTER_BITS)) + 1n;
    expect(expected).toBeGreaterThan(2n ** 53n);
    expect(lease.fence).toBe(expected);
    expect((await manager.inspect('big'))?.fence).toBe(expected);
    expect(splitRedisFence(lease.fence)).toEqual({ epoch: 2n ** 20n + 1n, counter: 1n });
    expect(await redis.hget(keys.fence, 'epoch')).toBe(String(2 ** 20 + 1));
    await lease.release();
  });

  it('takes a new epoch when the counter of an epoch is used up', async () => {
    const { manager, redis, keys } = await redisScenario(REDIS_URL);
    const first = await manager.acquire('n', { ttlMs: 5_000 });
    await first.release();
    await redis.hset(keys.fence, 'counter', (REDIS_MAX_COUNTER - 1n).toString());

    const last = await manager.acquire('n', { ttlMs: 5_000 });
    await last.release();
    const next = await manager.acquire('n', { ttlMs: 5_000 });
    await next.release();
    expect(splitRedisFence(last.fence)).toEqual({
      epoch: splitRedisFence(first.fence).epoch,
      counter: REDIS_MAX_COUNTER,
    });
    expect(next.fence).toBeGreaterThan(last.fence);
    expect(splitRedisFence(next.fence).epoch).toBeGreaterThan(splitRedisFence(last.fence).epoch);
    expect(splitRedisFence(next.fence).counter).toBe(1n);
  });

  it('takes a new epoch when the counter is lost or was written by another server', async () => {
    const { manager, redis, keys } = await redisScenario(REDIS_URL);
    const before = await manager.acquire('x', { ttlMs: 5_000 });
    await before.release();

    await redis.del(keys.fence); // as FLUSHDB or an eviction would
    const afterLoss = await manager.acquire('x', { ttlMs: 5_000 });
    await afterLoss.release();
    expect(afterLoss.fence).toBeGreaterThan(before.fence);

    // As after a failover or a restart from a snapshot: the state is there, but another server wrote it.
    await redis.hset(keys.fence, 'id', 'another-replid');
    const afterMove = await manager.acquire('x', { ttlMs: 5_000 });
    await afterMove.release();
    expect(afterMove.fence).toBeGreaterThan(afterLoss.fence);
    expect(splitRedisFence(afterMove.fence).epoch).toBeGreaterThan(splitRedisFence(afterLoss.fence).epoch);
  });

  it('the data history is the primary’s replication id; a server older than the minimum version gets no epoch, and nothing is written', async () => {
    const { manager, redis, keys } = await redisScenario(REDIS_URL);
    await (await manager.acquire('x', { ttlMs: 5_000 })).release();
    const replication = await redis.info('replication');
    expect(await redis.hget(keys.fence, 'id')).toBe(/^master_replid:(\w+)/m.exec(replication)?.[1]);

    const version = /^redis_version:([\d.]+)/m.exec(await redis.info('server'))?.[1] ?? '';
    const [major = 0, minor = 0] = version.split('.').map(Number);
    const run = scriptRunner(redis, [INSTALL_EPOCH_SCRIPT, BUMP_EPOCH_SCRIPT], commandDeadline(2_000));
    const state = await redis.hgetall(keys.fence);
    await redis.hset(keys.fence, 'id', 'another-replid'); // a new epoch is due
    const foreign = await redis.hgetall(keys.fence);
    for (const newer of [`${major}.${minor + 1}`, `${major + 1}.0`]) {
      expect(await runInstallEpoch(run, keys, 'nonce', 5_000, newer)).toEqual(['OLD', version]);
      expect(await runBumpEpoch(run, keys, state.epoch ?? '', newer)).toEqual(['OLD', version]);
      expect(await redis.hgetall(keys.fence)).toEqual(foreign);
    }
    // The server's own major.minor, and anything older, is recent enough.
    expect(await runInstallEpoch(run, keys, 'nonce', 5_000, `${major}.${minor}`)).toBe('INSTALLED');
    expect(await runInstallEpoch(run, keys, 'nonce', 5_000, `${major - 1}.${minor + 9}`)).toBe('INSTALLED');
    expect(await runInstallEpoch(run, keys, 'nonce', 5_000, REDIS_MIN_VERSION)).toBe('INSTALLED');
  });

  it('a new epoch that takes longer than waitMs is not counted in it: the acquire is granted, not called unreachable', async () => {
    const { open, test } = await redisScenario(REDIS_URL);
    // A slow Postgres (a loaded machine, a fresh connection): the epoch's nextval answers after waitMs has run out.
    const gate = pauseAfter(test.db, 'nextval');
    onTestFinished(gate.open);
    const waitMs = 200;
    const acquiring = open({ epochs: gate.db }).acquire('first', { ttlMs: 5_000, waitMs });
    await gate.reached;
    await sleep(2 * waitMs); // the attempt would have been cut short (and reported as Redis unreachable) by now
    gate.open();
    const lease = await acquiring;
    expect(splitRedisFence(lease.fence).epoch).toBeGreaterThan(0n);
    expect(await lease.release()).toBe('released');
  });

  it('an abort while a new epoch is installed ends the acquire at once; the grant that lands later is given back', async () => {
    const { manager, open, test } = await redisScenario(REDIS_URL);
    const gate = pauseAfter(test.db, 'nextval');
    onTestFinished(gate.open);
    const stopped = new AbortController();
    const waiting = open({ epochs: gate.db })
      .acquire('aborted', { ttlMs: 30_000, waitMs: 30_000, signal: stopped.signal })
      .catch((e: unknown) => e);
    await gate.reached;
    stopped.abort();
    // Settled while the install is still stuck: the abort did not wait for it.
    const err = await waiting;
    expect(err).toBeInstanceOf(LockUnavailableError);
    expect((err as LockUnavailableError).reason).toBe('aborted');
    gate.open();
    // The install finishes and its grant lands with nobody waiting: it is released, not left for its 30 s TTL.
    let info = await manager.inspect('aborted');
    for (let i = 0; i < 200 && info !== null; i++) {
      await sleep(50);
      info = await manager.inspect('aborted');
    }
    expect(info).toBeNull();
  });

  it('a lock register claim after a new epoch is still cut short at the end of waitMs (its database stuck), and named', async () => {
    const { open, test } = await redisScenario(REDIS_URL);
    // The claim's database has one connection, busy until the test ends: the claim waits in its queue.
    const stuck = postgres(test.url ?? '', { max: 1, onnotice: () => {} });
    onTestFinished(() => stuck.end({ timeout: 0 }));
    stuck`select pg_sleep(600)`.execute().catch(() => {});
    const manager = open({ claimRegisters: { db: drizzle(stuck) } });
    // A fresh namespace: the grant takes a new epoch first, which lifts the cut-off only while it runs.
    const err = await manager.acquire('claimed', { ttlMs: 5_000, waitMs: 300 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(LockServiceError);
    // Redis answered; the register's database did not: the error says which.
    expect((err as Error).message).toMatch(/^the lock register claim on claimRegisters\.db got no answer/);
  });

  it('a grant waits out an epoch install that another client abandoned, however long its placeholder lives', async () => {
    const { manager, open, test } = await redisScenario(REDIS_URL);
    const gate = pauseAfter(test.db, 'nextval');
    onTestFinished(gate.open);
    // Its placeholder lives 6 s (twice its command timeout): longer than the 200 rounds a grant once gave up after.
    const stalled = open({ epochs: gate.db, commandTimeoutMs: 3_000 });
    const stalledAcquire = stalled.acquire('a', { ttlMs: 5_000 }).catch((e: unknown) => e);
    const abandoned = await gate.reached;
    // A wait far shorter than the placeholder's 6 s, and long enough for the round trips around the install on a
    // busy machine (with 100 ms, the grant's first answer once missed it: the wait counts everything but the install).
    const lease = await manager.acquire('b', { ttlMs: 5_000, waitMs: 1_000 });
    expect(splitRedisFence(lease.fence).epoch).toBeGreaterThan(abandoned);
    expect(await stalledAcquire).toBeInstanceOf(CommandTimeoutError);
    gate.open();
    await lease.release();
  });

  it('never activates an epoch taken by a client that paused while the counter was lost and others went on', async () => {
    const { manager, open, redis, keys, test } = await redisScenario(REDIS_URL);
    // The paused client put its placeholder in Redis and took an epoch; then it stops until we let it go on.
    const gate = pauseAfter(test.db, 'nextval');
    onTestFinished(gate.open);
    const paused = open({ epochs: gate.db });
    const pausedLease = paused.acquire('p', { ttlMs: 5_000 });
    const staleEpoch = await gate.reached;
    expect(await redis.hget(keys.fence, 'state')).toBe('pending');
    await redis.del(keys.fence); // the counter, and the placeholder with it, is lost while the client is paused

    const issued: bigint[] = [];
    for (let i = 0; i < 3; i++) {
      const lease = await manager.acquire('q', { ttlMs: 5_000 });
      issued.push(lease.fence);
      await lease.release();
    }
    expect(splitRedisFence(issued[0] as never).epoch).toBeGreaterThan(staleEpoch);
    gate.open();

    const lease = await pausedLease;
    expect(lease.fence).toBeGreaterThan(issued[2] as bigint);
    // It found its placeholder gone and joined the newer epoch instead of activating its own.
    expect(splitRedisFence(lease.fence).epoch).toBe(splitRedisFence(issued[2] as never).epoch);
    expect(await redis.hget(keys.fence, 'epoch')).toBe(String(splitRedisFence(issued[2] as never).epoch));
    await lease.release();
  });

  it('an epoch install abandoned half-way (the client stalls after nextval) expires; others go on above it', async () => {
    const { manager, open, redis, keys, test } = await redisScenario(REDIS_URL);
    const gate = pauseAfter(test.db, 'nextval');
    onTestFinished(gate.open);
    const stalled = open({ epochs: gate.db, commandTimeoutMs: 400 }); // its pending install lives 1 s
    const stalledAcquire = stalled.acquire('a', { ttlMs: 5_000 }).catch((e: unknown) => e);
    const abandoned = await gate.reached; // it put its placeholder in Redis and took this epoch, then stalled
    expect(await redis.hget(keys.fence, 'state')).toBe('pending');

    const lease = await manager.acquire('b', { ttlMs: 5_000 }); // waits for the placeholder to expire
    expect(splitRedisFence(lease.fence).epoch).toBeGreaterThan(abandoned);
    expect(await stalledAcquire).toBeInstanceOf(CommandTimeoutError);
    gate.open();
    expect(await redis.hget(keys.fence, 'epoch')).toBe(String(splitRedisFence(lease.fence).epoch));
    await lease.release();
  });

  it('refuses to go below the epoch in Redis when epoch_seq went back (a restored database), until it passes it', async () => {
    const { manager, backend, redis, keys, test } = await redisScenario(REDIS_URL);
    await test.db.execute(sql`select setval('palisade.epoch_seq', 50)`);
    const first = await manager.acquire('r', { ttlMs: 5_000 });
    await first.release();
    const { epoch } = splitRedisFence(first.fence);
    expect(epoch).toBe(51n);
    const bare = backend();
    const token = randomBytes(16).toString('hex');
    expect((await bare.grant('held', token, 60_000, null))?.fence).toBe(first.fence + 1n); // held across the restore
    await test.db.execute(sql`select setval('palisade.epoch_seq', 1)`); // as a restore of an older backup would
    await redis.hset(keys.fence, 'id', 'another-replid'); // and the history changes: a new epoch is due

    const refused = await manager.acquire('r', { ttlMs: 5_000 }).catch((e: unknown) => e);
    expect(refused).toBeInstanceOf(FenceSourceError);
    expect(await manager.acquire('r', { ttlMs: 5_000 }).catch((e: unknown) => e)).toBeInstanceOf(FenceSourceError);
    expect(await redis.hget(keys.fence, 'epoch')).toBe(String(epoch)); // the floor stays in Redis
    // The state now stands at the floor's epoch under no known id: the lock held from that epoch, its grant
    // sent again, is given back rather than named after a guessed source — and not granted again meanwhile.
    expect(await redis.hget(keys.fence, 'source')).toBe('?');
    expect(await bare.grant('held', token, 60_000, null).catch((e: unknown) => e)).toBeInstanceOf(FenceSourceError);
    expect(await redis.exists(keys.lock('held'))).toBe(0);

    await test.db.execute(sql`select setval('palisade.epoch_seq', ${String(epoch + 10n)}::bigint)`);
    const after = await manager.acquire('r', { ttlMs: 5_000 });
    expect(after.fence).toBeGreaterThan(first.fence);
    await after.release();
  });

  it('without an epochs database, refuses a missing counter unless told it may start fresh', async () => {
    const { namespace, redis, keys } = await redisScenario(REDIS_URL);
    const strict = redisLockManager({ client: redis, namespace });
    const error = await strict.acquire('x', { ttlMs: 5_000 }).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(FenceSourceError);
    expect((error as FenceSourceError).code).toBe('fence_source');
    expect(await strict.inspect('x')).toBeNull(); // nothing was taken

    const fresh = redisLockManager({ client: redis, namespace, allowFreshCounter: true });
    const lease = await fresh.acquire('x', { ttlMs: 5_000 });
    expect(splitRedisFence(lease.fence)).toEqual({ epoch: 1n, counter: 1n });
    await lease.release();
    const second = await strict.acquire('x', { ttlMs: 5_000 }); // the counter exists now
    expect(second.fence).toBeGreaterThan(lease.fence);
    await second.release();

    await redis.hset(keys.fence, 'id', 'another-replid');
    await expect(strict.acquire('x', { ttlMs: 5_000 })).rejects.toBeInstanceOf(FenceSourceError);
    await strict.close();
    await fresh.close();
  });

  // The manager's own bad-input refusals are the contract's (test/fencing/contract.test.ts).
  it('refuses a namespace with a brace and a bad extend TTL before sending any command', async () => {
    const { manager, redis, namespace } = await redisScenario(REDIS_URL);
    const monitor = await redis.duplicate().monitor();
    const seen: string[][] = [];
    monitor.on('monitor', (_time: string, args: string[]) => {
      if (args.some((a) => a.includes(namespace))) seen.push(args);
    });
    expect(() => redisLockManager({ client: redis, namespace: 'bad}namespace' })).toThrow(InvalidArgumentError);

    // The monitor does see this namespace's commands: a valid call shows up, and only its commands are there.
    const valid = `valid-${'x'.repeat(1000)}`;
    const lease = await manager.acquire(valid, { ttlMs: 1_000 });
    await expect(lease.extend(0)).rejects.toBeInstanceOf(InvalidArgumentError);
    await lease.release();
    for (let i = 0; i < 100 && !seen.some((args) => args[0]?.toUpperCase() === 'PUBLISH'); i++) {
      await new Promise((r) => setTimeout(r, 20));
    }
    monitor.disconnect();
    expect(seen.length).toBeGreaterThan(0);
    const fenceKey = `{palisade:${namespace}}:fence`;
    expect(seen.filter((args) => !args.some((a) => a.includes(valid) || a === fenceKey))).toEqual([]);
  });

  it('aborts the lease signal with LeaseLostError when an extension finds the lock gone', async () => {
    const { manager, redis, keys } = await redisScenario(REDIS_URL);
    const lease = await manager.acquire('gone', { ttlMs: 30_000 });
    await redis.del(keys.lock('gone'));
    await expect(lease.extend()).rejects.toBeInstanceOf(LeaseLostError);
    expect(lease.signal.aborted).toBe(true);
    expect(lease.signal.reason).toBeInstanceOf(LeaseLostError);

    // The watchdog finds it too (it extends every ttl/3; the TTL is far off).
    const watched = await manager.acquire('gone', { ttlMs: 9_000, autoExtend: true });
    await redis.del(keys.lock('gone'));
    const reason = await aborted(watched.signal);
    expect(reason).toBeInstanceOf(LeaseLostError);
    expect(String((reason as Error).message)).toMatch(/extension/);
    expect(await watched.release()).toBe('lost');
  });

  it('the watchdog keeps a short lease alive and leaves no timer behind after release', async () => {
    const { manager } = await redisScenario(REDIS_URL);
    await (await manager.acquire('warm-up', { ttlMs: 1_000 })).release(); // connections are open
    const timers = trackTimers();
    onTestFinished(() => timers.stop());

    const lease = await manager.acquire('long', { ttlMs: 600, autoExtend: true });
    let extensions = 0;
    const off = manager.events.on('extended', () => extensions++);
    for (let i = 0; i < 300 && extensions < 3; i++) await new Promise((r) => setTimeout(r, 20));
    off();
    expect(extensions).toBeGreaterThanOrEqual(3);
    expect(lease.signal.aborted).toBe(false);
    expect((await timers.pending()).length).toBeGreaterThan(0); // the deadline and the watchdog
    expect(await lease.release()).toBe('released');
    expect(await timers.pending()).toEqual([]);

    // A release racing an extension in flight leaves nothing behind either.
    for (let i = 0; i < 5; i++) {
      const raced = await manager.acquire('long', { ttlMs: 60_000, autoExtend: true });
      const extension = raced.extend();
      expect(await raced.release()).toBe('released');
      await extension.catch(() => {});
      expect(await timers.pending()).toEqual([]);
    }
  });

  it('grants a contended lock to its waiters in the order they queued: the releaser and tryAcquire do not jump the line', async () => {
    const { manager, open, redis, keys } = await redisScenario(REDIS_URL);
    const inLine = async (n: number) => {
      for (let i = 0; i < 500; i++) {
        if ((await redis.zcard(keys.queue('fair'))) === n) return;
        await new Promise((r) => setTimeout(r, 10));
      }
      throw new Error(`the queue never held ${n} waiters`);
    };
    const order: string[] = [];
    const waitFor = (who: string, m: typeof manager) =>
      m.acquire('fair', { ttlMs: 30_000, waitMs: 20_000, holder: who }).then((lease) => {
        order.push(who);
        return lease;
      });

    const a = await manager.acquire('fair', { ttlMs: 30_000, holder: 'A' });
    const w1 = waitFor('W1', open());
    await inLine(1);
    const w2 = waitFor('W2', open());
    await inLine(2);
    expect(await open().tryAcquire('fair', { ttlMs: 30_000 })).toBeNull();
    expect(await redis.zcard(keys.queue('fair'))).toBe(2); // tryAcquire never queues

    expect(await a.release()).toBe('released');
    const again = waitFor('A', manager); // the releaser wants it back at once: it goes to the back
    const first = await w1;
    await inLine(2); // W2, then A
    expect(order).toEqual(['W1']);
    expect(await first.release()).toBe('released');
    const second = await w2;
    expect(order).toEqual(['W1', 'W2']);
    expect(await second.release()).toBe('released');
    const third = await again;
    expect(order).toEqual(['W1', 'W2', 'A']);
    expect([a.fence < first.fence, first.fence < second.fence, second.fence < third.fence]).toEqual([true, true, true]);
    expect(await redis.exists(keys.queue('fair'), keys.seen('fair'))).toBe(0); // the line is empty, its keys gone
    expect(await third.release()).toBe('released');
  });

  it('a waiter that stops retrying loses its place, and one that gives up leaves the line', async () => {
    const scenario = await redisScenario(REDIS_URL);
    const { manager, redis, keys } = scenario;
    const backend = scenario.backend();
    const lease = await manager.acquire('stuck', { ttlMs: 30_000 });
    const ghost = randomBytes(16).toString('hex');
    // A waiting grant that is never retried: a waiter killed or paused right after queueing.
    expect(await backend.grant('stuck', ghost, 30_000, 'ghost', { waiting: true })).toBeNull();
    expect(await redis.zrange(keys.queue('stuck'), '0', '-1')).toEqual([ghost]);
    expect(await redis.pttl(keys.queue('stuck'))).toBeGreaterThan(REDIS_QUEUE_STALE_MS);
    expect(await redis.pttl(keys.seen('stuck'))).toBeGreaterThan(REDIS_QUEUE_STALE_MS);

    expect(await lease.release()).toBe('released');
    // Free, but promised to the queued waiter (alive until the staleness bound): tryAcquire does not jump the line.
    expect(await manager.tryAcquire('stuck', { ttlMs: 30_000 })).toBeNull();
    // Once the ghost is stale, a waiting acquire gets the lock (waitMs bounds this).
    const next = await manager.acquire('stuck', { ttlMs: 30_000, waitMs: 10_000 });
    expect(next.fence).toBeGreaterThan(lease.fence);
    expect(await redis.zscore(keys.queue('stuck'), ghost)).toBeNull();

    // A waiting acquire that times out leaves the line (best effort, right after it gives up).
    await expect(manager.acquire('stuck', { ttlMs: 30_000, waitMs: 50 })).rejects.toBeInstanceOf(LockUnavailableError);
    for (let i = 0; i < 200 && (await redis.zcard(keys.queue('stuck'))) > 0; i++) {
      await new Promise((r) => setTimeout(r, 10));
    }
    expect(await redis.zcard(keys.queue('stuck'))).toBe(0);
    // leave() of a queued token removes it; of an unknown one, nothing.
    expect(await backend.grant('stuck', ghost, 30_000, 'ghost', { waiting: true })).toBeNull();
    expect(await redis.zcard(keys.queue('stuck'))).toBe(1);
    await backend.leave?.('stuck', ghost);
    await backend.leave?.('stuck', randomBytes(16).toString('hex'));
    expect(await redis.exists(keys.queue('stuck'), keys.seen('stuck'))).toBe(0);
    expect(await next.release()).toBe('released');
  });

  it('an uncontended grant spends no call on the line (counted on a server of its own)', async () => {
    const server = await startPrivateRedis();
    onTestFinished(() => server.stop());
    const { manager, redis } = await redisScenario(server.url);
    await (await manager.acquire('alone', { ttlMs: 30_000 })).release(); // the first grant installs an epoch
    await redis.config('RESETSTAT');
    for (let i = 0; i < 20; i++) await (await manager.acquire('alone', { ttlMs: 30_000 })).release();
    const stats = await redis.info('commandstats');
    expect(stats).toMatch(/cmdstat_evalsha:calls=40,/); // the 20 grants and 20 releases ran
    expect(stats).not.toMatch(/cmdstat_zrem:/);
  });

  it('a grant whose script was unknown to the server is not sent again after its call timed out: the give-back stays last', async () => {
    const server = await startPrivateRedis();
    onTestFinished(() => server.stop());
    const { open, redis, keys } = await redisScenario(server.url);
    const manager = open({ commandTimeoutMs: 300 });
    await (await manager.acquire('job', { ttlMs: 20_000 })).release(); // an epoch, the scripts loaded
    // As after a restart or a failover, with another client's release loaded again since.
    await redis.script('FLUSH');
    await redis.script('LOAD', RELEASE_SCRIPT.lua);
    server.pause();
    const outcome = await manager.tryAcquire('job', { ttlMs: 20_000 }).catch((e: unknown) => e);
    expect(outcome).toBeInstanceOf(CommandTimeoutError);
    // Queued in order: the grant (NOSCRIPT), then its give-back. A full script sent on the NOSCRIPT reply
    // would come after the give-back and take the lock for a token nobody holds, for its 20 s.
    server.resume();
    await sleep(200);
    await redis.ping();
    expect(await redis.exists(keys.lock('job'))).toBe(0);
    expect(await manager.tryAcquire('job', { ttlMs: 1_000 })).not.toBeNull();
  });

  it('a waiter behind more dead places than one grant drops keeps its place until they are gone, then leaves the line with its grant', async () => {
    const scenario = await redisScenario(REDIS_URL);
    const { manager, redis, keys } = scenario;
    const backend = scenario.backend();
    const lease = await manager.acquire('crowd', { ttlMs: 30_000 });
    const me = randomBytes(16).toString('hex');
    expect(await backend.grant('crowd', me, 30_000, null, { waiting: true })).toBeNull();
    // 100 places ahead of ours whose waiters left no trace of a retry (one grant drops at most 64).
    const dead = Array.from({ length: 100 }, () => randomBytes(16).toString('hex'));
    await redis.zadd(keys.queue('crowd'), ...dead.flatMap((token, i) => [String(-100 + i), token]));
    expect(await lease.release()).toBe('released');

    // The first grant drops 64 of them and keeps this waiter's place; the next drops the rest and grants.
    expect(await backend.grant('crowd', me, 30_000, null, { waiting: true })).toBeNull();
    expect(await redis.zcard(keys.queue('crowd'))).toBe(37);
    expect(await redis.zscore(keys.queue('crowd'), me)).not.toBeNull();
    expect(await backend.grant('crowd', me, 30_000, null, { waiting: true })).not.toBeNull();
    expect(await redis.zscore(keys.queue('crowd'), me)).toBeNull();
    expect(await redis.zscore(keys.seen('crowd'), me)).toBeNull();
    // Had it stayed in line, its own release would hand the lock back to it.
    expect(await backend.release('crowd', me)).toBe(true);
    const next = await manager.tryAcquire('crowd', { ttlMs: 30_000 });
    expect(next).not.toBeNull();
    await next?.release();
  });

  it('a release wakes the head of the line and waiters without a token, not the rest of the line', async () => {
    const scenario = await redisScenario(REDIS_URL);
    const { manager, redis, keys } = scenario;
    const backend = scenario.backend();
    const lease = await manager.acquire('bell', { ttlMs: 30_000 });
    const [head, second] = [randomBytes(16).toString('hex'), randomBytes(16).toString('hex')];
    expect(await backend.grant('bell', head, 30_000, null, { waiting: true })).toBeNull();
    expect(await backend.grant('bell', second, 30_000, null, { waiting: true })).toBeNull();
    expect(await redis.zrange(keys.queue('bell'), '0', '-1')).toEqual([head, second]);

    const woken: string[] = [];
    const hour = 3_600_000; // only a notification (or close) ends these waits in time
    const waits = [
      backend.waitForRelease('bell', hour, undefined, head).then(() => woken.push('head')),
      backend.waitForRelease('bell', hour, undefined, second).then(() => woken.push('second')),
      backend.waitForRelease('bell', hour, undefined).then(() => woken.push('no token')),
    ];
    for (let i = 0; i < 200; i++) {
      const [, subscribers] = (await redis.pubsub('NUMSUB', keys.channel)) as [string, number];
      if (Number(subscribers) > 0) break;
      await new Promise((r) => setTimeout(r, 10));
    }
    await lease.release();
    await Promise.all([waits[0], waits[2]]);
    expect(woken.sort()).toEqual(['head', 'no token']); // one message woke both; the second in line sleeps on
    await backend.close(); // ends the remaining wait
    await waits[1];
    expect(woken).toContain('second');
  });

  it('acquireAll takes every lock or none', async () => {
    const { manager, open } = await redisScenario(REDIS_URL);
    const leases = await manager.acquireAll(['b', 'a', 'c', 'a'], { ttlMs: 30_000 });
    expect(leases.map((l) => l.name)).toEqual(['a', 'b', 'c']);
    for (const lease of leases) await lease.release();

    const other = open();
    const held = await other.acquire('b', { ttlMs: 30_000 });
    await expect(manager.acquireAll(['a', 'b'], { ttlMs: 30_000, waitMs: 100 })).rejects.toBeInstanceOf(
      LockUnavailableError,
    );
    expect(await manager.inspect('a')).toBeNull();
    await held.release();
  });

  it('using() releases whether the function returns or throws', async () => {
    const { manager } = await redisScenario(REDIS_URL);
    expect(await manager.using('u', { ttlMs: 5_000 }, (lease) => lease.fence)).toBeTypeOf('bigint');
    expect(await manager.inspect('u')).toBeNull();
    await expect(
      manager.using('u', { ttlMs: 5_000 }, () => {
        throw new Error('job failed');
      }),
    ).rejects.toThrow('job failed');
    expect(await manager.inspect('u')).toBeNull();
  });

  // A manager reads its epochs database's id once. With that id changed since (a database created again at
  // the same address, or the id updated as for a copy), an older and a newer manager filed one epoch's
  // fences under two ids — two registers — and a stale holder's lock-scoped write landed (an attack).
  it("one epoch's grants name the id the epoch was taken under, whichever manager grants them", async () => {
    const { manager, open, test, redis, keys } = await redisScenario(REDIS_URL);
    const before = await manager.acquire('L', { ttlMs: 1_000 }); // reads the id, takes an epoch under it
    await before.release();
    await test.db.execute(sql`update palisade.fence_sources set source_id = 'pg:' || md5(random()::text)`);
    const started = open(); // reads the new id

    const stale = await manager.acquire('L', { ttlMs: 1_000 });
    const newer = await started.acquire('L', { ttlMs: 5_000, waitMs: 10_000 }); // once the stale one's TTL ran out
    expect(newer.fence).toBeGreaterThan(stale.fence);
    expect([stale.lock?.source, newer.lock?.source]).toEqual([before.lock?.source, before.lock?.source]);
    await expectStaleRefusedOnUntouchedRow(test, stale, newer);
    await newer.release();

    // A new epoch is filed under the id read with it: the fence state gone, the old manager takes one.
    await redis.del(keys.fence);
    const next = await manager.acquire('L', { ttlMs: 1_000 });
    const [row] = await execute(test.db, sql`select palisade.fence_source_id() as id`);
    expect(next.lock?.source).toBe(`redis-epochs:${String(row?.id)}`);
    expect(next.lock?.source).not.toBe(before.lock?.source);
    await next.release();
  });

  // An epoch made in Redis alone (by a manager without `epochs`) is filed under no id: managers with
  // `epochs` named it each after the id it knew, and with that id changed between them, one counter filled
  // two registers (an attack: a stale lock-scoped write landed). Such a manager now replaces that epoch.
  // The handoff path of the same rule: a release from an unfiled epoch hands the lock over with no id.
  it('a lock handed over from an epoch made without epochs reaches a manager with epochs under a filed epoch', async () => {
    const { namespace, redis, test, open } = await redisScenario(REDIS_URL);
    const fresh = redisLockManager({ client: redis, namespace, allowFreshCounter: true });
    onTestFinished(() => fresh.close());
    const unfiled = await fresh.acquire('L', { ttlMs: 10_000 });
    await test.db.execute(sql`select setval('palisade.epoch_seq', 100)`); // above the epoch made in Redis
    const waiting = open().acquire('L', { ttlMs: 5_000, waitMs: 10_000 });
    await sleep(300); // queued, and seen recently: the release hands the lock over
    await unfiled.release();
    const lease = await waiting;
    const [row] = await execute(test.db, sql`select palisade.fence_source_id() as id`);
    expect(lease.lock?.source).toBe(`redis-epochs:${row?.id}`);
    expect(splitRedisFence(lease.fence).epoch).toBe(101n);
    await lease.release();
  });

  it('an epoch made without epochs is replaced by one filed under the database id before a manager with epochs grants', async () => {
    const { namespace, redis, keys, test, open } = await redisScenario(REDIS_URL);
    const fresh = redisLockManager({ client: redis, namespace, allowFreshCounter: true });
    onTestFinished(() => fresh.close());
    const unfiled = await fresh.acquire('L', { ttlMs: 2_000 });
    expect(unfiled.lock).toBeUndefined();
    await unfiled.release();
    expect(await redis.hget(keys.fence, 'source')).toBeNull();

    const early = open();
    await test.db.execute(sql`select setval('palisade.epoch_seq', 100)`); // above the epoch made in Redis
    const [before] = await execute(test.db, sql`select palisade.fence_source_id() as id`);
    await (await early.acquire('warm', { ttlMs: 2_000 })).release();
    expect(await redis.hget(keys.fence, 'source')).toBe(before?.id);
    // A manager without epochs still grants from the filed epoch; its leases stay without a lock.
    const rowScoped = await fresh.acquire('L', { ttlMs: 2_000 });
    expect(rowScoped.lock).toBeUndefined();
    expect(splitRedisFence(rowScoped.fence).epoch).toBe(101n);
    await rowScoped.release();

    await test.db.execute(sql`update palisade.fence_sources set source_id = 'pg:' || md5(random()::text)`);
    const late = open();
    const stale = await early.acquire('L', { ttlMs: 1_000, autoExtend: false });
    const newer = await late.acquire('L', { ttlMs: 5_000, waitMs: 10_000 }); // once the stale one's TTL ran out
    expect([stale.lock?.source, newer.lock?.source]).toEqual([
      `redis-epochs:${before?.id}`,
      `redis-epochs:${before?.id}`,
    ]);
    await expectStaleRefusedOnUntouchedRow(test, stale, newer);
    await newer.release();
  });

  // A grant sent again with the same token finds the lock already its own; once the fence state has moved on
  // from that grant's epoch, which id the epoch was filed under is known no more (an attack: a waiter that
  // took a handed-over lock by its next grant named the manager's id, not the epoch's).
  it('a grant sent again after the fence state moved on gives the lock back and is granted afresh, under a known id', async () => {
    const { backend, redis, keys, test } = await redisScenario(REDIS_URL);
    const bare = backend();
    const token = randomBytes(16).toString('hex');
    const first = await bare.grant('L', token, 30_000, null);
    await redis.del(keys.fence); // evicted, say: the state of the first grant's epoch is gone
    const again = await bare.grant('L', token, 30_000, null);
    const [row] = await execute(test.db, sql`select palisade.fence_source_id() as id`);
    expect(first?.source).toBe(`redis-epochs:${String(row?.id)}`);
    expect(again?.source).toBe(first?.source);
    expect(again?.fence).toBeGreaterThan(first?.fence ?? 0n); // a new epoch's, not the first grant's again
    expect(await bare.release('L', token)).toBe(true);
  });
});
