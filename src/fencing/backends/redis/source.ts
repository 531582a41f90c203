/**
 * The fence source id of a Redis lock manager's namespace, for lock
 * registers (README, "Two scopes of fencing").
 */
import { databaseSourceId } from '../../source.js';
import type { RedisLockManagerOptions } from './backend.js';

/**
 * Which counter a Redis namespace's fences come from, or `undefined`: only
 * with `epochs` can fences be told apart at all. There they stay comparable
 * across every change of the Redis data history (a new epoch from that
 * database is above every earlier one), so the source is that database's:
 * `redis-epochs:<its fence_source_id>`. Without `epochs` nothing in Redis
 * can name the counter safely: an id kept in a key of its own can be lost
 * (evicted, deleted) while the counter survives, and the next manager would
 * then file the same counter's fences under a second id, in a second
 * register — so such leases carry no lock and stay row-scoped.
 */
export function redisFenceSource(options: RedisLockManagerOptions): (() => Promise<string>) | undefined {
  const epochs = options.epochs;
  if (epochs === undefined) return undefined;
  return async () => redisEpochsSource(await databaseSourceId(epochs));
}

/**
 * @internal The fence source of a grant whose epoch Redis filed under the id of the database it was
 * taken from (what the grant and release scripts reply), or `undefined` for none: then the manager's
 * own database names it ({@link redisFenceSource}). The epoch's own id is what makes grants of one
 * epoch agree — a manager reads its database's id once, and an id changed meanwhile (a database created
 * again at the same address) would file one epoch's fences under two ids, in two registers.
 */
export const epochSource = (id: string): string | undefined => (id === '' ? undefined : redisEpochsSource(id));

const redisEpochsSource = (id: string) => `redis-epochs:${id}`;
