/**
 * palisade: fencing-aware data access on Postgres. A lock grants a fence;
 * every write through a fenced repository is conditional on it, so the
 * database itself refuses a write from a holder whose lease has expired.
 * Every name is listed here (no `export *`): `test/exports.test.ts` pins
 * this entry's surface. Storage internals and tuning constants stay in
 * their modules; lock-backend authors have `palisade-db/backend`.
 */
export type { Database, DriverName } from './driver.js';
export {
  CliError,
  CommandTimeoutError,
  DatabaseError,
  DriverError,
  ERROR_CLASSES,
  ERROR_CODES,
  FenceNotIssuedError,
  FenceSourceError,
  ForeignLockError,
  InvalidArgumentError,
  LeaseLostError,
  LockManagerClosedError,
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
  UnsupportedDatabaseError,
} from './errors.js';
export { advisoryLockManager } from './fencing/backends/postgres-advisory/backend.js';
export { type LeaderRun, runIfLeader } from './fencing/backends/postgres-advisory/leader.js';
export type { AdvisoryLockManagerOptions } from './fencing/backends/postgres-advisory/options.js';
export { type PostgresLockManagerOptions, postgresLockManager } from './fencing/backends/postgres-lease/backend.js';
export { redisLockManager } from './fencing/backends/redis/manager.js';
export type { RedisClient, RedisLockManagerOptions } from './fencing/backends/redis/options.js';
export type { ClaimRegistersOption } from './fencing/eager-claim.js';
export type { LockEvents } from './fencing/events.js';
export { assertFence, type Fence, isFence, MAX_FENCE, toFence } from './fencing/fence.js';
export type { Lease } from './fencing/lease.js';
export { checkLockIdentity, type LockIdentity } from './fencing/lock-identity.js';
export type { LockManager } from './fencing/lock-manager.js';
export type { AcquireOptions } from './fencing/options.js';
export {
  MIGRATE_LOCK_KEY,
  MIGRATE_LOCK_NAME,
  type MigrateEvent,
  type MigrateOptions,
  type MigrateResult,
  type MigrationInfo,
  migrate,
} from './migrate.js';
export {
  type FencedTransactionOptions,
  type FencedTransactionResult,
  fencedTransaction,
  fencedTransactionOrThrow,
  type TransactionLease,
} from './repo/fenced-transaction.js';
export type { Refusal } from './repo/joined.js';
export { claimLockRegister } from './repo/register-claim.js';
export { fencedRepository } from './repo/repository.js';
export type {
  FencedRepository,
  FenceHolder,
  LeasedRepository,
  RepositoryOptions,
  StaleWriteEvent,
} from './repo/repository-api.js';
export { type BatchResult, mustApply, type WriteResult } from './repo/result.js';
export type { SameFence } from './repo/statements.js';
export type { FencedTable, KeyOf, PatchOf, RowOf, ValuesOf } from './repo/table.js';
export { fenceColumns } from './schema/fence-columns.js';
export {
  dropFenceTriggerStatements,
  FENCE_TRIGGER_NAME,
  FENCE_TRIGGER_SQLSTATE,
  type FenceTriggerOptions,
  type FenceTriggerTarget,
  fenceTriggerSql,
  fenceTriggerStatements,
  installFenceTrigger,
} from './schema/fence-trigger.js';
export { ATTR as TELEMETRY_ATTRIBUTES, type LostReason, METRICS, type MetricSpec } from './telemetry/catalog.js';
export {
  configureTelemetry,
  INSTRUMENTATION_SCOPE,
  type MeterProviderLike,
  type TelemetryOptions,
  type TracerProviderLike,
} from './telemetry/otel.js';
