/**
 * The fence source id of an etcd cluster's data, for lock registers
 * (README, "Two scopes of fencing").
 */
import { randomBytes } from 'node:crypto';
import type { IResponseHeader, ITxnRequest } from 'etcd3';
import type { EtcdKeyNames } from './keys.js';

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

/** @internal A key or value as etcd's gRPC messages take it. */
export const bytes = (s: string) => Buffer.from(s, 'utf8');

/**
 * The grant's transaction: the lock key and holder label on `leaseId` if
 * the lock key does not exist and the source key does; either way, the lock
 * key and the source key read in the same revision (responses 2 and 3 on
 * success, 0 and 1 on failure).
 */
export function grantRequest(
  keys: EtcdKeyNames,
  name: string,
  token: string,
  leaseId: string,
  holder: string | null,
): ITxnRequest {
  const lock = bytes(keys.lock(name));
  const source = bytes(keys.source);
  return {
    compare: [
      { key: lock, target: 'Create', result: 'Equal', create_revision: 0 },
      { key: source, target: 'Create', result: 'Greater', create_revision: 0 },
    ],
    success: [
      { request_put: { key: lock, value: bytes(token), lease: leaseId } },
      { request_put: { key: bytes(keys.holder(name)), value: bytes(JSON.stringify({ holder })), lease: leaseId } },
      { request_range: { key: lock } },
      { request_range: { key: source } },
    ],
    failure: [{ request_range: { key: lock } }, { request_range: { key: source } }],
  };
}

/** Puts a new random mark in the source key, unless it exists (no lease: it outlives every grant). */
export function sourceKeyRequest(keys: EtcdKeyNames): ITxnRequest {
  const source = bytes(keys.source);
  return {
    compare: [{ key: source, target: 'Create', result: 'Equal', create_revision: 0 }],
    success: [{ request_put: { key: source, value: bytes(randomBytes(12).toString('hex')) } }],
    failure: [],
  };
}

/**
 * How many fence sources {@link revisionFloors} remembers: past it, the one
 * seen longest ago is forgotten (its floor with it). A process meets a few
 * (one per namespace and cluster data); this bounds its memory.
 */
export const MAX_REMEMBERED_SOURCES = 1_000;

const floors = new Map<string, bigint>();

/**
 * The highest revision this process has seen of each fence source, shared
 * by every etcd backend of the process (so a new manager, and a manager
 * that has since granted from another source, still refuse a source that
 * went back); at most {@link MAX_REMEMBERED_SOURCES} sources, the least
 * recently seen forgotten first. Nothing survives the process.
 */
export const revisionFloors = {
  /**
   * The floors as they are now, for a grant to compare its fence with what
   * was seen before it was sent: a response of a later request (another
   * manager's, say) may carry a higher revision of the same source.
   */
  snapshot(): ReadonlyMap<string, bigint> {
    return new Map(floors);
  },
  /** Records that a response of `source` showed `revision`. */
  saw(source: string, revision: bigint): void {
    const known = floors.get(source);
    floors.delete(source); // re-inserted last: the most recently seen
    floors.set(source, known !== undefined && known > revision ? known : revision);
    if (floors.size > MAX_REMEMBERED_SOURCES) {
      const oldest = floors.keys().next().value;
      if (oldest !== undefined) floors.delete(oldest);
    }
  },
};
