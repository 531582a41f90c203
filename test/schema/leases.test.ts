import { sql } from 'drizzle-orm';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { migrate } from '../../src/migrate.js';
import { pgliteDatabase, type TestDatabase } from '../support/databases.js';

/** The lease table is updated on every grant and release: it must allow HOT updates (bench/sections/growth.ts measures why). */
describe('palisade.leases as migrated', () => {
  let test: TestDatabase;
  beforeAll(async () => {
    test = await pgliteDatabase();
    await migrate(test.db);
  });
  afterAll(async () => {
    await test?.close();
  });

  it('has no index on a column that grants and releases change — only the primary key', async () => {
    const { rows } = (await test.db.execute(
      sql`select indexname from pg_indexes where schemaname = 'palisade' and tablename = 'leases' order by 1`,
    )) as unknown as { rows: { indexname: string }[] };
    expect(rows.map((r) => r.indexname)).toEqual(['leases_namespace_name_pk']);
  });

  it('leaves room for HOT updates and is vacuumed after a fixed number of dead versions', async () => {
    const { rows } = (await test.db.execute(
      sql`select reloptions from pg_class where oid = 'palisade.leases'::regclass`,
    )) as unknown as { rows: { reloptions: string[] }[] };
    expect(rows[0]?.reloptions).toEqual(
      expect.arrayContaining(['fillfactor=70', 'autovacuum_vacuum_scale_factor=0', 'autovacuum_vacuum_threshold=1000']),
    );
  });
});
