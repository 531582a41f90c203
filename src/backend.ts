/**
 * `palisade-db/backend`: the extension point for lock services. A backend
 * implements {@link LockBackend}; {@link createLockManager} turns it into a
 * `LockManager` with leases, watchdogs, waits and events. The built-in
 * backends' factories are here for callers that compose their own manager
 * (etcd's stays behind `palisade-db/etcd`, which loads its optional peer).
 * The README's "Writing a lock backend" section is the manual.
 */
export type { Grant, GrantOptions, LockBackend, LockInfo } from './fencing/backend.js';
export { advisoryLockBackend } from './fencing/backends/postgres-advisory/backend.js';
export { postgresLockBackend } from './fencing/backends/postgres-lease/backend.js';
export { redisLockBackend } from './fencing/backends/redis/backend.js';
export { createLockManager, type LockManager, type LockManagerHooks } from './fencing/lock-manager.js';
