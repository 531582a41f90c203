/**
 * palisade's metrics and spans, read back through the real OpenTelemetry
 * SDK (in-memory exporters, no mocks): refused writes, lost leases, acquire
 * outcomes, what is never recorded (lock names, row values) — on the
 * Postgres lease backend over PGlite, so it needs no server.
 */
import type { PGlite } from '@electric-sql/pglite';
import { getTableName, sql } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/pglite';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Database } from '../../src/driver.js';
import { LeaseLostError, LockUnavailableError } from '../../src/errors.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { toFence } from '../../src/fencing/fence.js';
import type { LockManager } from '../../src/fencing/lock-manager.js';
import { migrate } from '../../src/migrate.js';
import { fencedRepository } from '../../src/repo/repository.js';
import { configureTelemetry } from '../../src/telemetry/otel.js';
import { createAccounts } from '../repo/fixtures.js';
import { newPglite } from '../support/pglite.js';
import { uniqueNamespace } from '../support/scenario.js';
import { exportedText, type TestSdk, testSdk } from './support.js';

function aborted(signal: AbortSignal): Promise<unknown> {
  return new Promise((resolve) => {
    if (signal.aborted) resolve(signal.reason);
    else signal.addEventListener('abort', () => resolve(signal.reason), { once: true });
  });
}

describe('telemetry through the real OpenTelemetry SDK (PGlite)', () => {
  let client: PGlite;
  let db: Database;
  let sdk: TestSdk;

  beforeAll(async () => {
    client = newPglite();
    db = drizzle(client) as unknown as Database;
    await migrate(db);
    sdk = testSdk();
    configureTelemetry({ meterProvider: sdk.meterProvider, tracerProvider: sdk.tracerProvider });
  });
  afterAll(async () => {
    configureTelemetry();
    await sdk?.shutdown();
    await client?.close();
  });

  const manager = (): LockManager =>
    postgresLockManager({ client: db, namespace: uniqueNamespace('otel'), listen: false });

  it('a stale write: exactly one refused-write count and one span with outcome stale; no key or value exported', async () => {
    const accounts = await createAccounts(db);
    const table = getTableName(accounts);
    const repo = fencedRepository(db, accounts);
    const key = 'secret-key-4f1c';
    expect((await repo.upsert({ id: key, owner: 'Jane Secretowner', balance: 7 }, toFence(5n))).status).toBe('applied');
    const stale = await repo.update({ id: key }, toFence(3n), { balance: 987654 });
    expect(stale).toEqual({ status: 'stale', currentFence: 5n });

    expect(await sdk.total('palisade.write.refused', { 'db.collection.name': table })).toBe(1);
    expect(
      await sdk.total('palisade.write.refused', { 'db.collection.name': table, 'palisade.write.outcome': 'stale' }),
    ).toBe(1);

    const spans = sdk.spans().filter((s) => s.attributes['db.collection.name'] === table);
    expect(spans.map((s) => s.attributes['palisade.write.outcome'])).toEqual(['applied', 'stale']);
    const staleSpan = spans[1];
    expect(staleSpan?.name).toBe(`UPDATE ${table}`);
    expect(staleSpan?.attributes).toMatchObject({
      'db.system.name': 'postgresql',
      'db.operation.name': 'UPDATE',
      'db.query.summary': `UPDATE ${table}`,
      'palisade.write.method': 'update',
      'palisade.fence': '3',
      'palisade.fence.current': '5',
    });
    expect(spans[0]?.name).toBe(`INSERT ${table}`);

    const exported = await exportedText(sdk);
    for (const secret of [key, 'Jane Secretowner', '987654']) expect(exported).not.toContain(secret);
  });

  it('duplicate, missing and a multi-row update are counted by outcome, each write with its span', async () => {
    const accounts = await createAccounts(db);
    const table = getTableName(accounts);
    const repo = fencedRepository(db, accounts);
    await repo.upsert({ id: 'a' }, toFence(2n));
    await repo.upsert({ id: 'b' }, toFence(9n));
    expect((await repo.update({ id: 'a' }, toFence(2n), { balance: 1 })).status).toBe('duplicate');
    expect((await repo.delete({ id: 'nobody' }, toFence(4n))).status).toBe('missing');
    expect(await repo.updateWhere(sql`true`, toFence(5n), { balance: 3 })).toEqual({ applied: 1, stale: 1 });

    const by = (outcome: string) =>
      sdk.total('palisade.write.refused', { 'db.collection.name': table, 'palisade.write.outcome': outcome });
    expect([await by('stale'), await by('duplicate'), await by('missing')]).toEqual([1, 1, 1]);
    const spans = sdk.spans().filter((s) => s.attributes['db.collection.name'] === table);
    expect(spans.map((s) => [s.attributes['palisade.write.method'], s.attributes['palisade.write.outcome']])).toEqual([
      ['upsert', 'applied'],
      ['upsert', 'applied'],
      ['update', 'duplicate'],
      ['delete', 'missing'],
      ['updateWhere', 'partial'],
    ]);
    expect(spans[4]?.attributes).toMatchObject({ 'palisade.write.rows_applied': 1, 'palisade.write.rows_stale': 1 });
  });

  it('a lost lease increments palisade.lock.lost with its reason (TTL ran out; an extension found it gone)', async () => {
    const locks = manager();
    const before = {
      ttl: await sdk.total('palisade.lock.lost', { 'palisade.lock.lost.reason': 'ttl_expired' }),
      refused: await sdk.total('palisade.lock.lost', { 'palisade.lock.lost.reason': 'extension_refused' }),
      failed: await sdk.total('palisade.lock.extensions', { 'palisade.lock.outcome': 'failed' }),
    };

    const short = await locks.acquire('job-ttl', { ttlMs: 100 });
    await aborted(short.signal); // nobody extends it: the local deadline passes
    expect(await sdk.total('palisade.lock.lost', { 'palisade.lock.lost.reason': 'ttl_expired' })).toBe(before.ttl + 1);

    // The lease row vanishes from the server (an operator, a restore): the next extension finds it gone.
    const gone = await locks.acquire('job-gone', { ttlMs: 30_000 });
    await db.execute(sql`delete from palisade.leases where name = 'job-gone'`);
    await expect(gone.extend()).rejects.toBeInstanceOf(LeaseLostError);
    expect(await sdk.total('palisade.lock.lost', { 'palisade.lock.lost.reason': 'extension_refused' })).toBe(
      before.refused + 1,
    );
    expect(await sdk.total('palisade.lock.extensions', { 'palisade.lock.outcome': 'failed' })).toBe(before.failed + 1);
    expect(await sdk.total('palisade.lock.lost', { 'palisade.lock.backend': 'postgres' })).toBe(
      before.ttl + before.refused + 2,
    );
    await short.release();
    await gone.release();
    await locks.close();
  });

  it('acquire outcomes, grants, extensions and hold time; spans for acquire, extend, release with the fence', async () => {
    const locks = manager();
    const count = (outcome: string) =>
      sdk.total('palisade.lock.acquire.duration', { 'palisade.lock.outcome': outcome });
    const before = {
      acquired: await count('acquired'),
      timeout: await count('timeout'),
      aborted: await count('aborted'),
      busy: await count('busy'),
      grants: await sdk.total('palisade.lock.grants'),
      extended: await sdk.total('palisade.lock.extensions', { 'palisade.lock.outcome': 'extended' }),
      held: await sdk.total('palisade.lock.hold.duration', { 'palisade.lock.outcome': 'released' }),
    };
    const lease = await locks.acquire('report', { ttlMs: 30_000 });
    await expect(locks.acquire('report', { ttlMs: 1000, waitMs: 30 })).rejects.toBeInstanceOf(LockUnavailableError);
    await expect(locks.acquire('report', { ttlMs: 1000, signal: AbortSignal.abort() })).rejects.toMatchObject({
      reason: 'aborted',
    });
    expect(await locks.tryAcquire('report', { ttlMs: 1000 })).toBeNull();
    await lease.extend();
    expect(await lease.release()).toBe('released');

    expect({
      acquired: await count('acquired'),
      timeout: await count('timeout'),
      aborted: await count('aborted'),
      busy: await count('busy'),
      grants: await sdk.total('palisade.lock.grants'),
      extended: await sdk.total('palisade.lock.extensions', { 'palisade.lock.outcome': 'extended' }),
      held: await sdk.total('palisade.lock.hold.duration', { 'palisade.lock.outcome': 'released' }),
    }).toEqual({
      acquired: before.acquired + 1,
      timeout: before.timeout + 1,
      aborted: before.aborted + 1,
      busy: before.busy + 1,
      grants: before.grants + 1,
      extended: before.extended + 1,
      held: before.held + 1,
    });

    const fence = lease.fence.toString();
    const ofLease = sdk
      .spans()
      .filter((s) => s.name.startsWith('palisade.lock.') && s.attributes['palisade.fence'] === fence);
    expect(ofLease.map((s) => s.name)).toEqual([
      'palisade.lock.acquire',
      'palisade.lock.extend',
      'palisade.lock.release',
    ]);
    expect(ofLease.map((s) => s.attributes['palisade.lock.outcome'])).toEqual(['acquired', 'extended', 'released']);
    await locks.close();
  });

  it('never records a lock name, unless a lockLabel function maps it to a label', async () => {
    const locks = manager();
    const name = 'invoice:jane.doe@example.com';
    await (await locks.acquire(name, { ttlMs: 5000 })).release();
    expect(await exportedText(sdk)).not.toContain('jane.doe');

    configureTelemetry({
      meterProvider: sdk.meterProvider,
      tracerProvider: sdk.tracerProvider,
      lockLabel: (n) => n.split(':')[0],
    });
    try {
      await (await locks.acquire(name, { ttlMs: 5000 })).release();
      expect(await sdk.total('palisade.lock.grants', { 'palisade.lock.label': 'invoice' })).toBe(1);
      const labelled = sdk.spans().filter((s) => s.attributes['palisade.lock.label'] === 'invoice');
      expect(labelled.map((s) => s.name)).toEqual(['palisade.lock.acquire', 'palisade.lock.release']);
      expect(await exportedText(sdk)).not.toContain('jane.doe');
    } finally {
      configureTelemetry({ meterProvider: sdk.meterProvider, tracerProvider: sdk.tracerProvider });
    }
    await locks.close();
  });

  it('with a meter provider and no tracing SDK, lock and write metrics are still recorded', async () => {
    const metricsOnly = testSdk();
    configureTelemetry({ meterProvider: metricsOnly.meterProvider });
    try {
      const locks = manager();
      await (await locks.acquire('metrics-only', { ttlMs: 5000 })).release();
      const accounts = await createAccounts(db);
      const repo = fencedRepository(db, accounts);
      expect((await repo.upsert({ id: 'm', owner: 'o', balance: 1 }, toFence(5n))).status).toBe('applied');
      expect((await repo.update({ id: 'm' }, toFence(4n), { balance: 2 })).status).toBe('stale');
      expect(await metricsOnly.total('palisade.lock.grants')).toBe(1);
      expect(await metricsOnly.total('palisade.lock.hold.duration')).toBe(1);
      const refused = { 'db.collection.name': getTableName(accounts) };
      expect(await metricsOnly.total('palisade.write.refused', refused)).toBe(1);
      await locks.close();
    } finally {
      configureTelemetry({ meterProvider: sdk.meterProvider, tracerProvider: sdk.tracerProvider });
      await metricsOnly.shutdown();
    }
  });
});
