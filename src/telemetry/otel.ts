/**
 * palisade's OpenTelemetry set-up: the configuration, the optional peer, the
 * instruments and the tracer, and the two events that are neither a lock
 * nor a write (fence sources, migration waits). The spans and metrics of
 * locks are in `locks.ts`, of writes in `writes.ts`; the README's
 * "Watching it in production" section is the manual.
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
import { ATTR, METRICS } from './catalog.js';

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

/** @internal */
export type Api = typeof Otel;
/** @internal */
export type Attributes = Record<string, string | number | boolean>;

let loadedApi: Api | null | undefined;
let options: TelemetryOptions = {};
let meterSource: unknown;
// `null`: the provider's meter is the API's no-op meter, nothing would record.
let instruments: Instruments | null | undefined;
let tracerSource: unknown;
let tracer: Otel.Tracer | undefined;
let version: string | undefined;

/** @internal The current configuration (see {@link configureTelemetry}). */
export function telemetryOptions(): TelemetryOptions {
  return options;
}

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

/** @internal `@opentelemetry/api`, loaded at the first call; `null` when it is not installed. */
export function api(): Api | null {
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
/**
 * @internal palisade's instruments on the configured (or global) meter
 * provider; `undefined` when nothing would record them (no
 * `@opentelemetry/api`, or only its no-op meter): the hooks then skip the
 * work of building attributes for them.
 */
export function meter(): Instruments | undefined {
  const otel = api();
  if (!otel) return undefined;
  const source = options.meterProvider ?? otel.metrics.getMeterProvider();
  if (source !== meterSource || instruments === undefined) {
    meterSource = source;
    const m = (source as Otel.MeterProvider).getMeter(INSTRUMENTATION_SCOPE, version);
    if (m === otel.createNoopMeter()) {
      instruments = null;
      return undefined;
    }
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
  }
  return instruments ?? undefined;
}

let noopTracerProvider: unknown;

/**
 * @internal palisade's tracer on the configured (or global) tracer provider,
 * or `undefined` where a span would record nothing: no `@opentelemetry/api`,
 * or its global provider with no SDK behind it — starting a no-op span
 * costs a few µs per lock cycle or write. Checked on every call, so an SDK
 * registered later is used from its first span on.
 */
export function getTracer(): Otel.Tracer | undefined {
  const otel = api();
  if (!otel || !tracingRegistered(otel)) return undefined;
  const source = options.tracerProvider ?? otel.trace.getTracerProvider();
  if (source !== tracerSource || !tracer) {
    tracer = (source as Otel.TracerProvider).getTracer(INSTRUMENTATION_SCOPE, version);
    tracerSource = source;
  }
  return tracer;
}

function tracingRegistered(otel: Api): boolean {
  if (options.tracerProvider) return true;
  const provider = otel.trace.getTracerProvider() as { getDelegate?: () => unknown };
  if (typeof provider.getDelegate !== 'function') return true;
  // A fresh proxy's delegate is the API's one no-op provider.
  noopTracerProvider ??= new otel.ProxyTracerProvider().getDelegate();
  return provider.getDelegate() !== noopTracerProvider;
}

/**
 * @internal `fn` inside an active span named `name` when `tracer` records
 * (see {@link getTracer}), else with no span at all.
 */
export function withSpan<T>(
  tracer: Otel.Tracer | undefined,
  name: string,
  spanOptions: Otel.SpanOptions,
  fn: (span: Otel.Span | undefined) => Promise<T>,
): Promise<T> {
  return tracer ? tracer.startActiveSpan(name, spanOptions, fn) : fn(undefined);
}

/** @internal Seconds since a `performance.now()` reading. */
export const seconds = (since: number) => (performance.now() - since) / 1000;

/** A span ended with an error: the error's code or class name only — messages may quote what they should not. */
export function failSpan(otel: Api, span: Otel.Span, err: unknown): string {
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

/**
 * @internal A fence-source event: `epoch_recovery` (the counter was missing,
 * foreign, exhausted, pending or unfiled — `reason` says which), `new_epoch` (an
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
