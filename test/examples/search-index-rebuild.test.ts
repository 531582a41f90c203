/**
 * examples/search-index-rebuild — build into a fresh table and swap it in
 * atomically; an admin trigger during a
 * rebuild answers at once who is rebuilding; a worker killed (kill -9)
 * mid-rebuild leaves the old index serving, its lock frees by TTL, and the
 * next run cleans up and completes.
 */
import { sql } from 'drizzle-orm';
import { afterEach, describe, expect, it } from 'vitest';
import { indexMeta, products, search, setup } from '../../examples/search-index-rebuild/index.js';
import { count, type Database, execute } from '../../src/driver.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { postgresDatabase } from '../support/databases.js';
import { killAllWorkers, type Message, startWorker } from '../support/processes.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';

const WORKER = 'test/workers/example-worker.ts';

afterEach(killAllWorkers);

const example = (messages: Message[], type: string) => messages.filter((m) => m.event === 'example' && m.type === type);

async function buildTables(db: Database): Promise<string[]> {
  const rows = await execute(
    db,
    sql`select tablename from pg_tables where schemaname = current_schema() and tablename like 'search_index_build_%' order by 1`,
  );
  return rows.map((r) => String(r.tablename));
}

describe.runIf(needs('DATABASE_URL'))(
  'examples/search-index-rebuild (real Postgres, separate processes)',
  { timeout: 120_000 },
  () => {
    it('admin trigger answers at once; kill -9 mid-rebuild; lock frees by TTL; next run completes cleanly', async () => {
      const test = await postgresDatabase();
      const namespace = uniqueNamespace('search');
      const base = { example: 'search-index-rebuild', databaseUrl: test.url, namespace };
      const observer = postgresLockManager({ client: test.db, namespace, listen: false });
      try {
        await setup(test.db);
        // A first, complete rebuild: the live index serves the catalogue.
        const first = startWorker(WORKER, { ...base, options: { ttlMs: 1500 } });
        const firstDone = (await first.next((m) => m.event === 'result', 60_000)).result as Record<string, unknown>;
        expect(firstDone.status).toBe('rebuilt');
        expect(await search(test.db, 'kettle')).toEqual([1, 8, 15, 22, 29, 36]);
        await test.db.insert(products).values({ id: 43, name: 'zeppelin', description: 'a large one' });

        // A rebuild that will crash: held after its first batch, then killed.
        const doomed = startWorker(WORKER, { ...base, options: { ttlMs: 1500 }, holdAt: { type: 'progress' } });
        await doomed.next((m) => m.event === 'holding', 60_000);
        const doomedFence = String(example(doomed.messages, 'started')[0]?.fence);

        // The admin clicks "rebuild": an immediate answer, naming the running rebuild.
        const admin = startWorker(WORKER, { ...base, options: { ttlMs: 1500 } });
        const adminDone = (await admin.next((m) => m.event === 'result', 60_000)).result as Record<string, unknown>;
        expect(adminDone.status).toBe('already-running');
        expect(String(adminDone.message)).toMatch(
          new RegExp(
            `^a rebuild is already running \\(started \\d{4}-\\d\\d-\\d\\dT[\\d:.]+Z by search-index pid ${doomed.pid}, fence ${doomedFence}\\)$`,
          ),
        );
        expect(example(admin.messages, 'started')).toEqual([]);

        doomed.kill();
        await doomed.exited;
        // The crash left its half-built table; the live index still serves the old build.
        expect(await buildTables(test.db)).toEqual([`search_index_build_${doomedFence}`]);
        expect(await search(test.db, 'zeppelin')).toEqual([]);
        expect(await search(test.db, 'kettle')).toEqual([1, 8, 15, 22, 29, 36]);

        // Nobody extends the dead worker's lease: it frees by TTL (bounded: 200 × 50 ms).
        for (let i = 0; i < 200 && (await observer.inspect('search-index-rebuild')) !== null; i++) {
          await new Promise((r) => setTimeout(r, 50));
        }
        expect(await observer.inspect('search-index-rebuild')).toBeNull();

        const next = startWorker(WORKER, { ...base, options: { ttlMs: 1500 } });
        const nextDone = (await next.next((m) => m.event === 'result', 60_000)).result as Record<string, unknown>;
        expect(nextDone.status).toBe('rebuilt');
        expect(example(next.messages, 'cleaned')[0]?.tables).toEqual([`search_index_build_${doomedFence}`]);
        expect(BigInt(String(nextDone.fence))).toBeGreaterThan(BigInt(doomedFence));
        expect(await buildTables(test.db)).toEqual([]);
        expect(await search(test.db, 'zeppelin')).toEqual([43]);
        expect(await search(test.db, 'kettle')).toEqual([1, 8, 15, 22, 29, 36]);
        const [meta] = await test.db.select().from(indexMeta);
        expect(meta).toMatchObject({
          builtBy: `search-index pid ${next.pid}`,
          lastFence: BigInt(String(nextDone.fence)),
        });
        const [terms] = await execute(test.db, sql`select count(*) as n from search_index`);
        expect(count(terms?.n)).toBe(meta?.terms);
      } finally {
        await observer.close();
        await test.close();
      }
    });
  },
);
