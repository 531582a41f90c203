/**
 * A database's fence source id changed while lock managers run (README,
 * "Two scopes of fencing"): each grant names the id its own statement
 * claimed the register under, so managers started before and after the
 * change fill one register per lock.
 */
import { sql } from 'drizzle-orm';
import postgres from 'postgres';
import { afterEach, describe, expect, it, onTestFinished } from 'vitest';
import { execute } from '../../src/driver.js';
import { advisoryLockManager } from '../../src/fencing/backends/postgres-advisory/backend.js';
import type { TestDatabase } from '../support/databases.js';
import { type BackendKind, type OpenManager, openManager } from '../support/managers.js';
import { expectStaleRefusedOnUntouchedRow, scenarioDatabase, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';
import { withholdingProxy } from '../support/withholding-proxy.js';

const opened: (OpenManager | TestDatabase)[] = [];
afterEach(async () => {
  for (const o of opened.splice(0).reverse()) await o.close();
});

const kinds: BackendKind[] = ['postgres', 'advisory'];

describe.runIf(needs('DATABASE_URL'))('an id changed while lock managers run', () => {
  it.each(kinds)(
    '%s: a manager started before the change names the new id from its next grant on, as one started after',
    async (kind) => {
      const scenario = await scenarioDatabase();
      opened.push(scenario);
      const config = { kind, namespace: uniqueNamespace('src'), databaseUrl: scenario.url as string };
      const early = await openManager(config);
      opened.push(early);
      const before = await early.manager.acquire('L', { ttlMs: 1_000 }); // its first grant: the one-time checks
      await before.release();
      await scenario.db.execute(sql`update palisade.fence_sources set source_id = 'pg:' || md5(random()::text)`);
      const [row] = await execute(scenario.db, sql`select palisade.fence_source_id() as id`);
      const late = await openManager(config);
      opened.push(late);

      const stale = await early.manager.acquire('L', { ttlMs: 1_000, autoExtend: false });
      const newer = await late.manager.acquire('L', { ttlMs: 5_000, waitMs: 10_000 }); // once the stale one's TTL ran out
      expect(newer.fence).toBeGreaterThan(stale.fence);
      expect(before.lock?.source).not.toBe(row?.id);
      expect([stale.lock?.source, newer.lock?.source]).toEqual([row?.id, row?.id]);
      await expectStaleRefusedOnUntouchedRow(scenario, stale, newer);
      await newer.release();
    },
  );

  // The advisory grant is one statement, whose snapshot the server takes when it is bound; the lock, the
  // fence and the id are taken when it is executed. A link that delivers the Bind and holds back the
  // Execute (a lost segment) let an id change and another manager's whole grant fall in between.
  it.each(['read committed', 'repeatable read'])(
    "advisory, %s: a grant executed after an id change and another's grant names the id of its execution",
    async (isolation) => {
      const scenario = await scenarioDatabase();
      opened.push(scenario);
      // Under REPEATABLE READ the bound snapshot is the transaction's: the id read fails (40001), the grant is asked again.
      const [{ name } = { name: '' }] = await execute(scenario.db, sql`select current_database() as name`);
      await scenario.db.execute(
        sql.raw(`alter database "${String(name)}" set default_transaction_isolation = '${isolation}'`),
      );
      const proxy = withholdingProxy(scenario.url as string);
      onTestFinished(() => proxy.close());
      const namespace = uniqueNamespace('src');
      const client = postgres(await proxy.url(), { max: 2, onnotice: () => {} });
      const split = advisoryLockManager({ client, namespace }); // its sessions go through the proxy too
      onTestFinished(async () => {
        proxy.release();
        await split.close();
        await client.end({ timeout: 2 });
      });
      const other = await openManager({ kind: 'advisory', namespace, databaseUrl: scenario.url as string });
      opened.push(other);
      // The one-time checks done, and the grant statement prepared on an idle session: Bind, Execute, Sync.
      await (await split.acquire('warm', { ttlMs: 5_000 })).release();

      proxy.state.splitAfterBind = true;
      const late = split.acquire('L', { ttlMs: 10_000, waitMs: 8_000 });
      for (let i = 0; i < 200 && proxy.splits === 0; i++) await sleep(10);
      expect(proxy.splits).toBe(1);
      await sleep(100); // the server has bound it: its snapshot is taken
      await scenario.db.execute(sql`update palisade.fence_sources set source_id = 'pg:' || md5(random()::text)`);
      const [row] = await execute(scenario.db, sql`select palisade.fence_source_id() as id`);
      const between = await other.manager.acquire('L', { ttlMs: 10_000, autoExtend: false });
      await between.release(); // its holder goes on as if it still held the lock: a stale one
      proxy.release();

      const newer = await late;
      expect(newer.fence).toBeGreaterThan(between.fence);
      expect([between.lock?.source, newer.lock?.source]).toEqual([row?.id, row?.id]);
      await expectStaleRefusedOnUntouchedRow(scenario, between, newer);
      await newer.release();
    },
  );
});
