export { FENCE_COLUMN_NAMES, fenceColumns } from './fence-columns.js';
export { epochSequence, fenceSequence, leases, palisadeSchema } from './palisade.js';
