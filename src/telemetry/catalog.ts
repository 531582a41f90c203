/**
 * Every metric palisade records, in one place: the instruments are created
 * from this list, and the README's metric table is tested against both this
 * list and what a real OpenTelemetry SDK received.
 */

/** One instrument palisade creates on its meter. */
export interface MetricSpec {
  readonly name: string;
  readonly instrument: 'histogram' | 'counter';
  /** UCUM unit, as the semantic conventions write it (`s`, `{grant}`). */
  readonly unit: string;
  readonly description: string;
  /** Attribute keys this metric carries (besides the optional `palisade.lock.label`). */
  readonly attributes: readonly string[];
}

/** Attribute keys, shared by metrics and spans. */
export const ATTR = {
  backend: 'palisade.lock.backend',
  lockOutcome: 'palisade.lock.outcome',
  lockLabel: 'palisade.lock.label',
  lostReason: 'palisade.lock.lost.reason',
  fence: 'palisade.fence',
  currentFence: 'palisade.fence.current',
  writeMethod: 'palisade.write.method',
  writeOutcome: 'palisade.write.outcome',
  rowsApplied: 'palisade.write.rows_applied',
  rowsStale: 'palisade.write.rows_stale',
  fenceSourceEvent: 'palisade.fence_source.event',
  fenceSourceReason: 'palisade.fence_source.reason',
  migrateOutcome: 'palisade.migrate.outcome',
  errorType: 'error.type',
  dbSystem: 'db.system.name',
  dbCollection: 'db.collection.name',
  dbOperation: 'db.operation.name',
  dbSummary: 'db.query.summary',
} as const;

/** The metrics, in the order of the README table. */
export const METRICS = [
  {
    name: 'palisade.lock.acquire.duration',
    instrument: 'histogram',
    unit: 's',
    description: 'Time an acquire (or tryAcquire) took, waiting included.',
    attributes: [ATTR.backend, ATTR.lockOutcome],
  },
  {
    name: 'palisade.lock.hold.duration',
    instrument: 'histogram',
    unit: 's',
    description: 'Time from grant to release of a lease.',
    attributes: [ATTR.backend, ATTR.lockOutcome],
  },
  {
    name: 'palisade.lock.grants',
    instrument: 'counter',
    unit: '{grant}',
    description: 'Leases granted (each with a new fence).',
    attributes: [ATTR.backend],
  },
  {
    name: 'palisade.lock.extensions',
    instrument: 'counter',
    unit: '{extension}',
    description: 'Lease extensions (manual or by the watchdog), by outcome.',
    attributes: [ATTR.backend, ATTR.lockOutcome],
  },
  {
    name: 'palisade.lock.lost',
    instrument: 'counter',
    unit: '{lease}',
    description: 'Leases known or presumed lost before their release, by reason.',
    attributes: [ATTR.backend, ATTR.lostReason],
  },
  {
    name: 'palisade.write.refused',
    instrument: 'counter',
    unit: '{row}',
    description: 'Fenced writes the database refused, by table and outcome.',
    attributes: [ATTR.dbCollection, ATTR.writeOutcome],
  },
  {
    name: 'palisade.fence_source.events',
    instrument: 'counter',
    unit: '{event}',
    description: 'Fence-source events: epoch recoveries, new epochs, durable-floor checks.',
    attributes: [ATTR.backend, ATTR.fenceSourceEvent, ATTR.fenceSourceReason],
  },
  {
    name: 'palisade.migrate.wait.duration',
    instrument: 'histogram',
    unit: 's',
    description: 'Time a migrate() waited for another migrator to finish.',
    attributes: [ATTR.migrateOutcome],
  },
] as const satisfies readonly MetricSpec[];

/** Why a lease was lost, as the `palisade.lock.lost.reason` attribute says it. */
export type LostReason = 'ttl_expired' | 'extension_refused' | 'extension_failed' | 'connection_dropped';
