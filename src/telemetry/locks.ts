/** Spans and metrics of lock grants, waits, extensions, losses and releases (the README's "Watching it in production"). */
import { performance } from 'node:perf_hooks';
import { ATTR, type LostReason } from './catalog.js';
import { type Attributes, api, failSpan, getTracer, meter, seconds, telemetryOptions, withSpan } from './otel.js';

// Built afresh each time, never by spreading: `{ ...a, [key]: v }` costs ~1.3 µs here (a slow
// clone path in V8), a quarter of the whole no-SDK budget of a lock cycle.
function lockAttributes(backend: string, name: string, key?: string, value?: string): Attributes {
  const attributes: Attributes = { [ATTR.backend]: backend };
  if (key !== undefined && value !== undefined) attributes[key] = value;
  const { lockLabel } = telemetryOptions();
  if (lockLabel) {
    try {
      const label = lockLabel(name);
      if (typeof label === 'string') attributes[ATTR.lockLabel] = label;
    } catch {
      // A labelling function's failure must not change what happens to the lock.
    }
  }
  return attributes;
}

function acquireOutcome(err: unknown): string {
  const reason = (err as { code?: unknown; reason?: unknown } | null)?.reason;
  if ((err as { code?: unknown } | null)?.code === 'lock_unavailable' && (reason === 'timeout' || reason === 'aborted'))
    return reason;
  return 'error';
}

/**
 * @internal Wraps one acquire (`acquire`, each lock of `acquireAll`, or a
 * `tryAcquire`, where `null` is the outcome `busy`): a span over the whole
 * wait, the wait-time histogram by outcome, and the grant count.
 */
export async function observeAcquire<L extends { readonly fence: bigint } | null>(
  backend: string,
  name: string,
  run: () => Promise<L>,
): Promise<L> {
  const otel = api();
  if (!otel) return run();
  const t = getTracer();
  const m = meter();
  if (!t && !m) return run(); // nothing would record
  const startedAt = performance.now();
  const attributes = lockAttributes(backend, name);
  return withSpan(t, 'palisade.lock.acquire', { attributes }, async (span) => {
    try {
      const lease = await run();
      const outcome = lease ? 'acquired' : 'busy';
      span?.setAttribute(ATTR.lockOutcome, outcome);
      if (lease) span?.setAttribute(ATTR.fence, lease.fence.toString());
      m?.acquire.record(seconds(startedAt), lockAttributes(backend, name, ATTR.lockOutcome, outcome));
      if (lease) m?.grants.add(1, attributes);
      return lease;
    } catch (err) {
      const outcome = acquireOutcome(err);
      span?.setAttribute(ATTR.lockOutcome, outcome);
      if (outcome === 'error' && span) failSpan(otel, span, err);
      m?.acquire.record(seconds(startedAt), lockAttributes(backend, name, ATTR.lockOutcome, outcome));
      throw err;
    } finally {
      span?.end();
    }
  });
}

/** @internal Wraps one extension: a span and the extensions count by outcome (`extended` / `failed`). */
export async function observeExtend(backend: string, name: string, fence: bigint, run: () => Promise<void>) {
  const otel = api();
  if (!otel) return run();
  const t = getTracer();
  if (!t && !meter()) return run();
  const span = t?.startSpan('palisade.lock.extend', {
    attributes: lockAttributes(backend, name, ATTR.fence, fence.toString()),
  });
  let outcome = 'extended';
  try {
    await run();
  } catch (err) {
    outcome = 'failed';
    if (span) failSpan(otel, span, err);
    throw err;
  } finally {
    span?.setAttribute(ATTR.lockOutcome, outcome);
    meter()?.extensions.add(1, lockAttributes(backend, name, ATTR.lockOutcome, outcome));
    span?.end();
  }
}

/**
 * @internal Wraps a lease's release: a span, and the hold time (grant to
 * release) by outcome (`released`, or `lost` when the lock was no longer held).
 */
export async function observeRelease(
  backend: string,
  name: string,
  fence: bigint,
  grantedAt: number,
  run: () => Promise<'released' | 'lost'>,
): Promise<'released' | 'lost'> {
  const otel = api();
  if (!otel) return run();
  const t = getTracer();
  if (!t && !meter()) return run();
  const span = t?.startSpan('palisade.lock.release', {
    attributes: lockAttributes(backend, name, ATTR.fence, fence.toString()),
  });
  let outcome = 'error';
  try {
    outcome = await run();
    return outcome as 'released' | 'lost';
  } catch (err) {
    if (span) failSpan(otel, span, err);
    throw err;
  } finally {
    span?.setAttribute(ATTR.lockOutcome, outcome);
    meter()?.hold.record(seconds(grantedAt), lockAttributes(backend, name, ATTR.lockOutcome, outcome));
    span?.end();
  }
}

/** @internal A lease was lost before its release: counted by reason, and an event on the active span. */
export function recordLost(backend: string, name: string, fence: bigint, reason: LostReason): void {
  const otel = api();
  if (!otel) return;
  meter()?.lost.add(1, lockAttributes(backend, name, ATTR.lostReason, reason));
  otel.trace
    .getActiveSpan()
    ?.addEvent('palisade.lock.lost', { [ATTR.lostReason]: reason, [ATTR.fence]: fence.toString() });
}
