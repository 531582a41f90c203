/**
 * palisade-db/testing: helpers to prove your own write path is fenced, and the
 * history checker used by palisade's chaos runs.
 */
export { type AuditRow, type CheckInput, checkHistory, formatReport, type Report } from './checker.js';
export { type HistoryEvent, historyRecorder, historyTime, readHistory } from './history.js';
export { assertStaleWriteRefused, type StaleWriteOutcome, type StaleWriteScenario } from './stale-write.js';
