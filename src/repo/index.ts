export { type FencedTransactionResult, fencedTransaction, fencedTransactionOrThrow } from './fenced-transaction.js';
export { fencedRepository } from './repository.js';
export type {
  FencedRepository,
  FenceHolder,
  LeasedRepository,
  RepositoryOptions,
  StaleWriteEvent,
} from './repository-api.js';
export { type BatchResult, mustApply, type WriteResult } from './result.js';
export type { SameFence } from './statements.js';
export type { FencedTable, KeyOf, PatchOf, RowOf, ValuesOf } from './table.js';
