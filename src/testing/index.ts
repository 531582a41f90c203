/**
 * palisade-db/testing: helpers to prove your own write path is fenced, the
 * lock backend contract suite, and the history checker used by palisade's
 * chaos runs.
 */
export { type AuditRow, type CheckInput, checkHistory, formatReport, type Report } from './checker.js';
export {
  type ContractExpect,
  type ContractRunner,
  type ContractSubject,
  describeLockBackend,
  type LockBackendContract,
} from './contract.js';
export { type HistoryEvent, historyRecorder, historyTime, readHistory } from './history.js';
export { assertStaleWriteRefused, type StaleWriteOutcome, type StaleWriteScenario } from './stale-write.js';
