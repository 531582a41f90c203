export {
  type FencedRepository,
  type FenceHolder,
  fencedRepository,
  type LeasedRepository,
  type RepositoryOptions,
  type StaleWriteEvent,
} from './repository.js';
export { type BatchResult, mustApply, type WriteResult } from './result.js';
export type { SameFence } from './statements.js';
export type { FencedTable, KeyOf, PatchOf, RowOf, ValuesOf } from './table.js';
