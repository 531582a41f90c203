/**
 * Fence sources: which counter issued a fence, so that lock registers never
 * compare fences of two counters (README, "Two scopes of fencing").
 */
import { sql } from 'drizzle-orm';
import { type Database, execute, transaction } from '../driver.js';
import { FenceSourceError } from '../errors.js';
import { forwardTo, type Grant, type LockBackend } from './backend.js';

/**
 * This database's id as a fence source (`palisade.fence_source_id()`,
 * generated once by palisade's migration 0005): the source of every fence
 * from its `palisade.fence_seq`. With `lockWaitMs`, a lock on
 * `palisade.fence_sources` (an operator's `ALTER TABLE`) is waited for at
 * most that long, on the server (SQLSTATE 55P03 then): in a transaction
 * whose `lock_timeout` is set first, since the function is inlined, and its
 * table locked, when the statement that calls it is planned.
 * @throws {FenceSourceError} when the migration has not run.
 */
export async function databaseSourceId(db: Database, lockWaitMs?: number): Promise<string> {
  const read = (on: Database) => execute(on, sql`select palisade.fence_source_id() as id`);
  let rows: Awaited<ReturnType<typeof execute>>;
  try {
    rows =
      lockWaitMs === undefined
        ? await read(db)
        : await transaction(db, async (tx) => {
            await execute(tx, sql`select set_config('lock_timeout', ${String(lockWaitMs)}::text, true)`);
            return read(tx);
          });
  } catch (err) {
    if (err instanceof Error && /fence_source_id/.test(err.message)) {
      throw new FenceSourceError("the database has no palisade.fence_source_id(): run palisade's migrations (0005)");
    }
    throw err;
  }
  const id = rows[0]?.id;
  if (typeof id !== 'string' || id.length === 0) {
    throw new FenceSourceError('palisade.fence_sources holds no id: run palisade migration 0005_lock_registers again');
  }
  return id;
}

/**
 * `backend` with `namespace` and every grant's `source` set — unless the
 * backend named one itself — from `source()` (asked once, and again only
 * after it failed): for backends whose source id takes a round trip of its
 * own to learn (a Redis deployment's epochs database, for epochs activated
 * before Redis kept their database's id; not an etcd cluster, which a
 * restore replaces: its grants name it themselves). A grant whose source cannot be learnt is given back and the
 * error thrown, so no lease exists without its lock identity.
 */
export function withFenceSource(backend: LockBackend, namespace: string, source: () => Promise<string>): LockBackend {
  let known: Promise<string> | undefined;
  let learnt: string | undefined; // the id once known: no extra await on every grant
  const sourceId = (): Promise<string> => {
    known ??= source().then(
      (id) => {
        learnt = id;
        return id;
      },
      (err: unknown) => {
        known = undefined;
        throw err;
      },
    );
    return known;
  };
  const base = forwardTo(backend, namespace);
  const handover = base.waitForTurn;
  return {
    ...base,
    async grant(...args: Parameters<LockBackend['grant']>): Promise<Grant | null> {
      const id = learnt ?? (await sourceId());
      const grant = await base.grant(...args);
      // A source the backend named with the grant (Redis: the one its epoch is filed under) comes first.
      return grant === null ? null : withSource(grant, grant.source ?? id);
    },
    ...(handover
      ? {
          // Never rejects (the contract): a source not learnt yet makes a handover a plain wake-up,
          // and the waiter's next grant call (same token: the same grant) learns it or fails.
          async waitForTurn(...args: Parameters<NonNullable<LockBackend['waitForTurn']>>) {
            const grant = await handover(...args);
            if (grant === undefined) return undefined;
            const id = grant.source ?? learnt ?? (await known?.catch(() => undefined));
            return id === undefined ? undefined : withSource(grant, id);
          },
        }
      : {}),
  };
}

// Field by field, not `{ ...grant, source }`: spreading an object takes a slow clone path in V8,
// on every acquire.
function withSource(grant: Grant, source: string): Grant {
  const out: { fence: Grant['fence']; source: string; lost?: AbortSignal; confirmWithinMs?: number } = {
    fence: grant.fence,
    source,
  };
  if (grant.lost !== undefined) out.lost = grant.lost;
  if (grant.confirmWithinMs !== undefined) out.confirmWithinMs = grant.confirmWithinMs;
  return out;
}
