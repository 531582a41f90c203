/** The Postgres advisory-lock backend; the README's "Postgres leases and advisory locks" section is its manual. */
export {
  type AdvisoryLockManagerOptions,
  advisoryKey,
  advisoryLockBackend,
  advisoryLockManager,
  type LeaderRun,
  runIfLeader,
} from './backend.js';
