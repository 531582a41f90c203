/**
 * The fence source id of an etcd cluster, for lock registers (README, "Two
 * scopes of fencing").
 */
import type { IResponseHeader } from 'etcd3';

/**
 * `etcd:<cluster_id>`, read from the header of the very response that
 * issued a fence: revisions — the fences — are global to one etcd cluster,
 * and the id every member's responses carry names it. A cluster replaced or
 * restored from a snapshot into a new cluster gets a new id (and its
 * revisions may go back: see the backend's notes), so the id is never
 * remembered from an earlier call: a process that outlived its cluster would
 * otherwise name the new cluster's fences after the old one, and claim the
 * old cluster's registers with them.
 * `undefined` when the header names no cluster.
 */
export function etcdFenceSource(header: IResponseHeader | undefined): string | undefined {
  const id = header?.cluster_id;
  return id ? `etcd:${id}` : undefined;
}
