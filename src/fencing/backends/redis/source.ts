/**
 * The fence source id of a Redis lock manager's namespace, for lock
 * registers (README, "Two scopes of fencing").
 */
import { randomBytes } from 'node:crypto';
import { LockServiceError } from '../../../errors.js';
import { databaseSourceId } from '../../source.js';
import type { RedisClient, RedisLockManagerOptions } from './backend.js';

/**
 * Which counter a Redis namespace's fences come from. With `epochs`, fences
 * stay comparable across every change of the Redis data history (a new
 * epoch from that database is above every earlier one), so the source is
 * that database's: `redis-epochs:<its fence_source_id>`. Without it, one id
 * stored in Redis itself once (`{palisade:<ns>}:source`, `SET NX`): the
 * deployment's. A flush loses it — and the counter with it, which such a
 * manager then refuses to restart (unless `allowFreshCounter`, whose fences
 * may go down anyway).
 */
export function redisFenceSource(options: RedisLockManagerOptions, namespace: string): () => Promise<string> {
  if (options.epochs !== undefined) {
    const epochs = options.epochs;
    return async () => `redis-epochs:${await databaseSourceId(epochs)}`;
  }
  const client = options.client as RedisClient & {
    set(key: string, value: string, nx: 'NX'): Promise<unknown>;
    get(key: string): Promise<string | null>;
  };
  const key = `{palisade:${namespace}}:source`;
  return async () => {
    await client.set(key, `redis:${randomBytes(16).toString('hex')}`, 'NX');
    const id = await client.get(key);
    if (typeof id !== 'string' || id.length === 0) {
      throw new LockServiceError('redis', 'the Redis fence source id could not be read', undefined);
    }
    return id;
  };
}
