/**
 * palisade: fencing-aware data access on Postgres. A lock grants a fence;
 * every write through a fenced repository is conditional on it, so the
 * database itself refuses a write from a holder whose lease has expired.
 */
export { type Database, DatabaseError, type DriverName } from './driver.js';
export {
  ERROR_CODES,
  FenceNotIssuedError,
  FenceSourceError,
  InvalidArgumentError,
  LeaseLostError,
  LockScopeError,
  LockServiceError,
  LockTimeoutError,
  LockUnavailableError,
  MigrationsFolderError,
  MissingDependencyError,
  PalisadeError,
  type PalisadeErrorCode,
  RetryableWriteError,
  RowMissingError,
  StaleFenceError,
} from './errors.js';
export * from './fencing/index.js';
export {
  MIGRATE_LOCK_KEY,
  MIGRATE_LOCK_NAME,
  type MigrateEvent,
  type MigrateOptions,
  type MigrateResult,
  type MigrationInfo,
  migrate,
  PALISADE_MIGRATIONS,
} from './migrate.js';
export * from './repo/index.js';
export * from './schema/index.js';
export * from './telemetry/index.js';
