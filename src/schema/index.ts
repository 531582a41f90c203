export { FENCE_COLUMN_NAMES, fenceColumns } from './fence-columns.js';
export {
  dropFenceTriggerStatements,
  FENCE_TRIGGER_NAME,
  FENCE_TRIGGER_SQLSTATE,
  type FenceTriggerOptions,
  type FenceTriggerTarget,
  fenceTriggerSql,
  fenceTriggerStatements,
  installFenceTrigger,
} from './fence-trigger.js';
export { epochSequence, fenceSequence, fenceSources, leases, lockRegisters, palisadeSchema } from './palisade.js';
