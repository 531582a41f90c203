/**
 * The real OpenTelemetry SDK with in-memory exporters, for the telemetry
 * suites: what palisade recorded is read back exactly as an exporter would
 * receive it.
 */
import {
  AggregationTemporality,
  InMemoryMetricExporter,
  MeterProvider,
  type MetricData,
  PeriodicExportingMetricReader,
} from '@opentelemetry/sdk-metrics';
import {
  BasicTracerProvider,
  InMemorySpanExporter,
  type ReadableSpan,
  SimpleSpanProcessor,
} from '@opentelemetry/sdk-trace-base';

export interface TestSdk {
  readonly meterProvider: MeterProvider;
  readonly tracerProvider: BasicTracerProvider;
  /** Every metric as the exporter received it at this moment (cumulative since the start). */
  metrics(): Promise<MetricData[]>;
  /** Spans ended so far. */
  spans(): ReadableSpan[];
  /** Sum of a counter's points, or the count of a histogram's, whose attributes include `match`. */
  total(name: string, match?: Record<string, unknown>): Promise<number>;
  shutdown(): Promise<void>;
}

export function testSdk(): TestSdk {
  const metricExporter = new InMemoryMetricExporter(AggregationTemporality.CUMULATIVE);
  // Exports only when flushed (the interval is an hour): reads are explicit.
  const reader = new PeriodicExportingMetricReader({ exporter: metricExporter, exportIntervalMillis: 3_600_000 });
  const meterProvider = new MeterProvider({ readers: [reader] });
  const spanExporter = new InMemorySpanExporter();
  const tracerProvider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(spanExporter)] });

  async function metrics(): Promise<MetricData[]> {
    metricExporter.reset();
    await reader.forceFlush();
    return metricExporter.getMetrics().flatMap((rm) => rm.scopeMetrics.flatMap((sm) => sm.metrics));
  }

  return {
    meterProvider,
    tracerProvider,
    metrics,
    spans: () => spanExporter.getFinishedSpans(),
    async total(name, match = {}) {
      let sum = 0;
      for (const metric of await metrics()) {
        if (metric.descriptor.name !== name) continue;
        for (const point of metric.dataPoints) {
          const attrs = point.attributes as Record<string, unknown>;
          if (!Object.entries(match).every(([k, v]) => attrs[k] === v)) continue;
          const value = point.value as number | { count: number };
          sum += typeof value === 'number' ? value : value.count;
        }
      }
      return sum;
    },
    async shutdown() {
      await meterProvider.shutdown();
      await tracerProvider.shutdown();
    },
  };
}

/** Everything an exporter would ship, as one string: to prove a secret never appears in it. */
export async function exportedText(sdk: TestSdk): Promise<string> {
  const metrics = await sdk.metrics();
  const spans = sdk.spans().map((s) => ({ name: s.name, attributes: s.attributes, events: s.events }));
  return JSON.stringify({ metrics: metrics.map((m) => ({ d: m.descriptor, p: m.dataPoints })), spans }, (_, v) =>
    typeof v === 'bigint' ? v.toString() : v,
  );
}
