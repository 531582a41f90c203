/**
 * The fence source id of an etcd cluster, for lock registers (README, "Two
 * scopes of fencing").
 */
import type { Etcd3 } from 'etcd3';
import { LockServiceError } from '../../../errors.js';

/**
 * `etcd:<cluster_id>`: revisions — the fences — are global to one etcd
 * cluster, and the id that every member's responses carry names it. A
 * cluster restored from a snapshot into a new cluster gets a new id (and
 * its revisions may go back: see the backend's notes).
 */
export function etcdFenceSource(client: Etcd3): () => Promise<string> {
  return async () => {
    let id: string | undefined;
    try {
      id = (await client.maintenance.status()).header?.cluster_id;
    } catch (err) {
      throw new LockServiceError('etcd', 'the etcd cluster id could not be read', err);
    }
    if (!id) throw new LockServiceError('etcd', 'the etcd cluster sent no cluster id', undefined);
    return `etcd:${id}`;
  };
}
