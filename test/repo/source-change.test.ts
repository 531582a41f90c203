/**
 * A database's fence source id changed while lock managers run (README,
 * "Two scopes of fencing"): each grant names the id its own statement
 * claimed the register under, so managers started before and after the
 * change fill one register per lock.
 */
import { sql } from 'drizzle-orm';
import { afterEach, describe, expect, it } from 'vitest';
import { execute } from '../../src/driver.js';
import type { TestDatabase } from '../support/databases.js';
import { type BackendKind, type OpenManager, openManager } from '../support/managers.js';
import { expectStaleRefusedOnUntouchedRow, scenarioDatabase, uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

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
});
