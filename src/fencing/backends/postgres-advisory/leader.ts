/** `runIfLeader`, the scheduler singleton; the README's "Postgres leases and advisory locks" section is its manual. */
import { InvalidArgumentError } from '../../../errors.js';
import type { Lease } from '../../lease.js';
import type { LockManager } from '../../lock-manager.js';
import type { AcquireOptions } from '../../options.js';

/** What {@link runIfLeader} did: `ran: false` when another process holds the lock. */
export type LeaderRun<T> = { readonly ran: true; readonly result: T } | { readonly ran: false };

/**
 * The scheduler singleton: tries the lock once, without
 * waiting; if granted, runs `job(lease)` and always releases, whether the
 * job returns or throws (its error is rethrown). Works with any lock
 * manager; with `advisoryLockManager` the lock also frees by itself if
 * this process dies mid-job.
 *
 * Guarantees: `job` runs only while this process holds the lock, and at most
 * once per call. Does not: stop `job` when the lease is lost — watch
 * `lease.signal`, and write with `lease.fence` through a fenced repository
 * so a late write after a loss is refused.
 * @throws {InvalidArgumentError} for a bad name, options or `job`, before any query.
 */
export async function runIfLeader<T>(
  manager: LockManager,
  name: string,
  job: (lease: Lease) => Promise<T> | T,
  options: AcquireOptions,
): Promise<LeaderRun<T>> {
  if (typeof job !== 'function') throw new InvalidArgumentError('runIfLeader needs a job function');
  const lease = await manager.tryAcquire(name, options);
  if (!lease) return { ran: false };
  try {
    return { ran: true, result: await job(lease) };
  } finally {
    await lease.release();
  }
}
