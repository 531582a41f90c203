/**
 * palisade-db/testing: helpers to prove your own write path is fenced, the
 * lock backend contract suite, and the history recorder and checker for your
 * own chaos runs (the README's "How we know" section). The chaos runner's
 * clock (`historyTime`) stays in `history.ts`.
 */
export { type AuditRow, type CheckInput, checkHistory, formatReport, type Report } from './checker.js';
export {
  type ContractExpect,
  type ContractRunner,
  type ContractSubject,
  describeLockBackend,
  type LockBackendContract,
} from './contract.js';
export { type HistoryEvent, historyRecorder, readHistory } from './history.js';
export { assertStaleWriteRefused, type StaleWriteOutcome, type StaleWriteScenario } from './stale-write.js';
