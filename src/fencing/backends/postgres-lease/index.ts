/** The Postgres lease-table backend; the README's "Postgres leases and advisory locks" section is its manual. */
export { type PostgresLockManagerOptions, postgresLockBackend, postgresLockManager } from './backend.js';
