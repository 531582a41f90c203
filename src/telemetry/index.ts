export { ATTR as TELEMETRY_ATTRIBUTES, type LostReason, METRICS, type MetricSpec } from './catalog.js';
export {
  configureTelemetry,
  INSTRUMENTATION_SCOPE,
  type MeterProviderLike,
  type TelemetryOptions,
  type TracerProviderLike,
} from './otel.js';
