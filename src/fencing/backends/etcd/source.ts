/**
 * The fence source id of an etcd cluster's data, for lock registers
 * (README, "Two scopes of fencing").
 */
import { randomBytes } from 'node:crypto';
import type { IResponseHeader } from 'etcd3';

/**
 * `etcd:<cluster_id>:<mark>`, read from the very response that issued a
 * fence: its header's cluster id, and the namespace's source key (`mark`),
 * a random value palisade puts there once. Revisions — the fences — are
 * global to one cluster's data. The cluster id alone does not tell data
 * apart: etcd derives it from the member names, peer URLs and cluster
 * token, so a cluster wiped and started again with the same flags keeps it
 * while its revisions start over. A wipe takes the source key with it, and
 * the next grant puts a new one: a new source. A restore from a snapshot
 * brings the key back (README, "etcd", for what an operator does then).
 * Never remembered from an earlier call: a process that outlived its
 * cluster would otherwise name the new data's fences after the old.
 * `undefined` when the header names no cluster.
 */
export function etcdFenceSource(header: IResponseHeader | undefined, mark: string): string | undefined {
  const id = header?.cluster_id;
  return id ? `etcd:${id}:${mark}` : undefined;
}

/** A new value for a namespace's source key. */
export const newSourceMark = (): string => randomBytes(12).toString('hex');
