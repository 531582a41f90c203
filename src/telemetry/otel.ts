/**
 * palisade's OpenTelemetry instrumentation: metrics and spans for lock
 * grants, waits, extensions, losses, releases and every repository write.
 *
 * `@opentelemetry/api` is an optional peer dependency, loaded with
 * `require` at the first instrumented call (no top-level await, so the
 * package stays loadable with `require()`). Without it every hook is a
 * no-op; with it but without a registered SDK the API's own no-op
 * instruments answer. Nothing here ever records a row value, a query
 * parameter or — unless the user maps it to a label — a lock name.
 */
import { createRequire } from 'node:module';
import { performance } from 'node:perf_hooks';
import type * as Otel from '@opentelemetry/api';
import { ATTR, type LostReason, METRICS } from './catalog.js';

/** The instrumentation scope palisade's meter and tracer use. */
export const INSTRUMENTATION_SCOPE = 'palisade';

/** Anything with OpenTelemetry's `MeterProvider` shape (typed loosely so the peer stays optional). */
export interface MeterProviderLike {
  getMeter(name: string, version?: string): unknown;
}

/** Anything with OpenTelemetry's `TracerProvider` shape. */
export interface TracerProviderLike {
  getTracer(name: string, version?: string): unknown;
}

/** Options of {@link configureTelemetry}. */
export interface TelemetryOptions {
  /** Where metrics go (default: the global provider of `@opentelemetry/api`, looked up at each call). */
  readonly meterProvider?: MeterProviderLike;
  /** Where spans go (default: the global provider of `@opentelemetry/api`). */
  readonly tracerProvider?: TracerProviderLike;
  /**
   * Maps a lock name to a low-cardinality label (say `billing:42` →
   * `billing`), added to lock metrics and spans as `palisade.lock.label`.
   * Lock names are never recorded otherwise: they can be unbounded in
   * number and may carry personal data. Return `undefined` for no label.
   * Called synchronously; a throw means no label.
   */
  readonly lockLabel?: (name: string) => string | undefined;
}

type Api = typeof Otel;
type Attributes = Record<string, string | number | boolean>;

let loadedApi: Api | null | undefined;
let options: TelemetryOptions = {};
let meterSource: unknown;
let instruments: Instruments | undefined;
let tracerSource: unknown;
let tracer: Otel.Tracer | undefined;
let version: string | undefined;

/**
 * Sets where palisade's metrics and spans go and how lock names become
 * labels. Optional: without it palisade uses the global providers of
 * `@opentelemetry/api` (so an SDK registered globally just works).
 * Replaces any earlier configuration. Does not register anything globally.
 */
export function configureTelemetry(next: TelemetryOptions = {}): void {
  options = { ...next };
  meterSource = undefined;
  tracerSource = undefined;
}

/**
 * @internal For the benchmark only: `false` makes every hook take the path
 * it takes when `@opentelemetry/api` is not installed, so the cost of the
 * instrumentation itself can be measured in one process; `true` loads the
 * package again at the next call.
 */
export function setTelemetryLoaded(loaded: boolean): void {
  loadedApi = loaded ? undefined : null;
  meterSource = undefined;
  tracerSource = undefined;
}

function api(): Api | null {
  if (loadedApi === undefined) {
    const require = createRequire(import.meta.url);
    try {
      loadedApi = require('@opentelemetry/api') as Api;
    } catch {
      loadedApi = null; // the optional peer is not installed: every hook is a no-op
    }
    try {
      version = (require('../../package.json') as { version?: string }).version;
    } catch {
      version = undefined;
    }
  }
  return loadedApi;
}

interface Instruments {
  acquire: Otel.Histogram;
  hold: Otel.Histogram;
  grants: Otel.Counter;
  extensions: Otel.Counter;
  lost: Otel.Counter;
  refused: Otel.Counter;
  fenceSource: Otel.Counter;
  migrateWait: Otel.Histogram;
}

// Instruments are rebuilt when the provider changes: the API hands out a
// no-op meter until an SDK is registered, and keeps handing out that one.
function meter(): Instruments | undefined {
  const otel = api();
  if (!otel) return undefined;
  const source = options.meterProvider ?? otel.metrics.getMeterProvider();
  if (source !== meterSource || !instruments) {
    const m = (source as Otel.MeterProvider).getMeter(INSTRUMENTATION_SCOPE, version);
    const make = (i: number) => {
      const spec = METRICS[i] as (typeof METRICS)[number];
      const opts = { unit: spec.unit, description: spec.description };
      return spec.instrument === 'histogram' ? m.createHistogram(spec.name, opts) : m.createCounter(spec.name, opts);
    };
    instruments = {
      acquire: make(0) as Otel.Histogram,
      hold: make(1) as Otel.Histogram,
      grants: make(2) as Otel.Counter,
      extensions: make(3) as Otel.Counter,
      lost: make(4) as Otel.Counter,
      refused: make(5) as Otel.Counter,
      fenceSource: make(6) as Otel.Counter,
      migrateWait: make(7) as Otel.Histogram,
    };
    meterSource = source;
  }
  return instruments;
}

function getTracer(): Otel.Tracer | undefined {
  const otel = api();
  if (!otel) return undefined;
  const source = options.tracerProvider ?? otel.trace.getTracerProvider();
  if (source !== tracerSource || !tracer) {
    tracer = (source as Otel.TracerProvider).getTracer(INSTRUMENTATION_SCOPE, version);
    tracerSource = source;
  }
  return tracer;
}

// Built afresh each time, never by spreading: `{ ...a, [key]: v }` costs ~1.3 µs here (a slow
// clone path in V8), a quarter of the whole no-SDK budget of a lock cycle.
function lockAttributes(backend: string, name: string, key?: string, value?: string): Attributes {
  const attributes: Attributes = { [ATTR.backend]: backend };
  if (key !== undefined && value !== undefined) attributes[key] = value;
  if (options.lockLabel) {
    try {
      const label = options.lockLabel(name);
      if (typeof label === 'string') attributes[ATTR.lockLabel] = label;
    } catch {
      // A labelling function's failure must not change what happens to the lock.
    }
  }
  return attributes;
}

const seconds = (since: number) => (performance.now() - since) / 1000;

/** A span ended with an error: the error's code or class name only — messages may quote what they should not. */
function failSpan(otel: Api, span: Otel.Span, err: unknown): string {
  const type =
    err && typeof err === 'object' && typeof (err as { code?: unknown }).code === 'string'
      ? (err as { code: string }).code
      : err instanceof Error
        ? err.name
        : 'error';
  span.setAttribute(ATTR.errorType, type);
  span.setStatus({ code: otel.SpanStatusCode.ERROR });
  return type;
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
  const t = getTracer();
  if (!otel || !t) return run();
  const startedAt = performance.now();
  const attributes = lockAttributes(backend, name);
  return t.startActiveSpan('palisade.lock.acquire', { attributes }, async (span) => {
    const m = meter();
    try {
      const lease = await run();
      const outcome = lease ? 'acquired' : 'busy';
      span.setAttribute(ATTR.lockOutcome, outcome);
      if (lease) span.setAttribute(ATTR.fence, lease.fence.toString());
      m?.acquire.record(seconds(startedAt), lockAttributes(backend, name, ATTR.lockOutcome, outcome));
      if (lease) m?.grants.add(1, attributes);
      return lease;
    } catch (err) {
      const outcome = acquireOutcome(err);
      span.setAttribute(ATTR.lockOutcome, outcome);
      if (outcome === 'error') failSpan(otel, span, err);
      m?.acquire.record(seconds(startedAt), lockAttributes(backend, name, ATTR.lockOutcome, outcome));
      throw err;
    } finally {
      span.end();
    }
  });
}

/** @internal Wraps one extension: a span and the extensions count by outcome (`extended` / `failed`). */
export async function observeExtend(backend: string, name: string, fence: bigint, run: () => Promise<void>) {
  const otel = api();
  const t = getTracer();
  if (!otel || !t) return run();
  const span = t.startSpan('palisade.lock.extend', {
    attributes: lockAttributes(backend, name, ATTR.fence, fence.toString()),
  });
  let outcome = 'extended';
  try {
    await run();
  } catch (err) {
    outcome = 'failed';
    failSpan(otel, span, err);
    throw err;
  } finally {
    span.setAttribute(ATTR.lockOutcome, outcome);
    meter()?.extensions.add(1, lockAttributes(backend, name, ATTR.lockOutcome, outcome));
    span.end();
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
  const t = getTracer();
  if (!otel || !t) return run();
  const span = t.startSpan('palisade.lock.release', {
    attributes: lockAttributes(backend, name, ATTR.fence, fence.toString()),
  });
  let outcome = 'error';
  try {
    outcome = await run();
    return outcome as 'released' | 'lost';
  } catch (err) {
    failSpan(otel, span, err);
    throw err;
  } finally {
    span.setAttribute(ATTR.lockOutcome, outcome);
    meter()?.hold.record(seconds(grantedAt), lockAttributes(backend, name, ATTR.lockOutcome, outcome));
    span.end();
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

/** The outcome of one fenced single-row write, as the repository returns it. */
interface WriteOutcome {
  readonly status: 'applied' | 'stale' | 'duplicate' | 'missing';
  readonly currentFence?: bigint;
}

let noopTracerProvider: unknown;

/**
 * False while the global tracer provider has no SDK behind it (and none was
 * configured): its spans record nothing, yet starting one costs ~5 µs — a
 * twentieth of a fenced write's client CPU. Checked on every write, so an
 * SDK registered later is used from its first span on.
 */
function tracingRegistered(otel: Api): boolean {
  if (options.tracerProvider) return true;
  const provider = otel.trace.getTracerProvider() as { getDelegate?: () => unknown };
  if (typeof provider.getDelegate !== 'function') return true;
  // A fresh proxy's delegate is the API's one no-op provider.
  noopTracerProvider ??= new otel.ProxyTracerProvider().getDelegate();
  return provider.getDelegate() !== noopTracerProvider;
}

/**
 * @internal Wraps one fenced single-row write: a client span named like the
 * database conventions ask (`UPDATE accounts`) with the table, the fence and
 * the outcome; a refused write (`stale`, `duplicate`, `missing`) is counted.
 * Never a row value, a key or a query parameter.
 */
export async function observeWrite<R extends WriteOutcome>(
  table: string,
  method: string,
  operation: 'UPDATE' | 'INSERT',
  fence: bigint,
  run: () => Promise<R>,
): Promise<R> {
  const otel = api();
  const t = getTracer();
  if (!otel || !t) return run();
  if (!tracingRegistered(otel)) {
    // No span would record anything: only the refusal count (a meter may be registered on its own).
    const result = await run();
    if (result.status !== 'applied')
      meter()?.refused.add(1, { [ATTR.dbCollection]: table, [ATTR.writeOutcome]: result.status });
    return result;
  }
  const summary = `${operation} ${table}`;
  const attributes: Attributes = {
    [ATTR.dbSystem]: 'postgresql',
    [ATTR.dbCollection]: table,
    [ATTR.dbOperation]: operation,
    [ATTR.dbSummary]: summary,
    [ATTR.writeMethod]: method,
    [ATTR.fence]: fence.toString(),
  };
  return t.startActiveSpan(summary, { kind: otel.SpanKind.CLIENT, attributes }, async (span) => {
    try {
      const result = await run();
      span.setAttribute(ATTR.writeOutcome, result.status);
      if (result.status === 'stale' && result.currentFence !== undefined)
        span.setAttribute(ATTR.currentFence, result.currentFence.toString());
      if (result.status !== 'applied')
        meter()?.refused.add(1, { [ATTR.dbCollection]: table, [ATTR.writeOutcome]: result.status });
      return result;
    } catch (err) {
      span.setAttribute(ATTR.writeOutcome, 'error');
      failSpan(otel, span, err);
      throw err;
    } finally {
      span.end();
    }
  });
}

/** @internal Wraps a fenced multi-row update: a span with the rows applied and refused; refused rows counted as `stale`. */
export async function observeBatch<R extends { readonly applied: number; readonly stale: number }>(
  table: string,
  fence: bigint,
  run: () => Promise<R>,
): Promise<R> {
  const otel = api();
  const t = getTracer();
  if (!otel || !t) return run();
  const summary = `UPDATE ${table}`;
  const attributes: Attributes = {
    [ATTR.dbSystem]: 'postgresql',
    [ATTR.dbCollection]: table,
    [ATTR.dbOperation]: 'UPDATE',
    [ATTR.dbSummary]: summary,
    [ATTR.writeMethod]: 'updateWhere',
    [ATTR.fence]: fence.toString(),
  };
  return t.startActiveSpan(summary, { kind: otel.SpanKind.CLIENT, attributes }, async (span) => {
    try {
      const result = await run();
      span.setAttributes({
        [ATTR.rowsApplied]: result.applied,
        [ATTR.rowsStale]: result.stale,
        [ATTR.writeOutcome]: result.stale === 0 ? 'applied' : result.applied === 0 ? 'stale' : 'partial',
      });
      if (result.stale > 0)
        meter()?.refused.add(result.stale, { [ATTR.dbCollection]: table, [ATTR.writeOutcome]: 'stale' });
      return result;
    } catch (err) {
      span.setAttribute(ATTR.writeOutcome, 'error');
      failSpan(otel, span, err);
      throw err;
    } finally {
      span.end();
    }
  });
}

/**
 * @internal A fence-source event: `epoch_recovery` (the counter was missing,
 * foreign, exhausted or pending — `reason` says which), `new_epoch` (an
 * epoch was installed), `floor_check` (an epoch from Postgres checked against
 * the floor Redis still holds: `confirmed`, or `behind` when the sequence went back).
 */
export function recordFenceSource(
  backend: string,
  event: 'epoch_recovery' | 'new_epoch' | 'floor_check',
  reason: string,
): void {
  if (!api()) return;
  meter()?.fenceSource.add(1, {
    [ATTR.backend]: backend,
    [ATTR.fenceSourceEvent]: event,
    [ATTR.fenceSourceReason]: reason,
  });
}

/** @internal A `migrate()` that had to wait for another migrator: how long, and whether it then got the lock. */
export function recordMigrateWait(startedAt: number, outcome: 'locked' | 'timeout' | 'error'): void {
  if (!api()) return;
  meter()?.migrateWait.record(seconds(startedAt), { [ATTR.migrateOutcome]: outcome });
}
