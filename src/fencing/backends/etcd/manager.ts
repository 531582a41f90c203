/** The etcd lock manager; the README's "etcd" section and "What each guarantees" are its manual. */

import { forwardTo } from '../../backend.js';
import { checkClaimRegisters, withEagerClaim } from '../../eager-claim.js';
import { createLockManager, type LockManager } from '../../lock-manager.js';
import { checkNamespace } from '../../options.js';
import { etcdLockBackend } from './backend.js';
import type { EtcdLockManagerOptions } from './options.js';

/**
 * A lock manager on an etcd v3 cluster: the fence is the revision at which
 * the lock key was created, an etcd lease with keep-alive is the watchdog.
 * What it guarantees and what it does not is the README's ("What each
 * guarantees — and what it does not", etcd).
 * @throws {InvalidArgumentError} for bad options.
 */
export function etcdLockManager(options: EtcdLockManagerOptions): LockManager {
  const backend = etcdLockBackend(options);
  // Leases carry their lock (kind, the cluster's id, namespace, name) for lock-scoped writes: each grant
  // names the cluster its response came from (./source.ts).
  return createLockManager(
    withEagerClaim(forwardTo(backend, checkNamespace(options.namespace)), checkClaimRegisters(options.claimRegisters)),
  );
}
