/** Spans and the refusal count of fenced repository writes (the README's "Watching it in production"). */
import { ATTR } from './catalog.js';
import { type Attributes, api, failSpan, getTracer, meter, withSpan } from './otel.js';

/** The outcome of one fenced single-row write, as the repository returns it. */
interface WriteOutcome {
  readonly status: 'applied' | 'stale' | 'duplicate' | 'missing';
  readonly currentFence?: bigint;
}

/**
 * @internal Wraps one fenced single-row write: a client span named like the
 * database conventions ask (`UPDATE accounts`) with the table, the fence and
 * the outcome; a refused write (`stale`, `duplicate`, `missing`) is counted.
 * Never a row value, a key or a query parameter.
 */
export function observeWrite<R extends WriteOutcome>(
  table: string,
  method: string,
  operation: 'UPDATE' | 'INSERT',
  fence: bigint,
  run: () => Promise<R>,
): Promise<R> {
  // Not async: where nothing records, the write's own promise is returned as it is.
  const otel = api();
  if (!otel) return run();
  const t = getTracer();
  if (!t && !meter()) return run(); // nothing would record: not even a refusal count
  const summary = `${operation} ${table}`;
  const attributes: Attributes | undefined = t && {
    [ATTR.dbSystem]: 'postgresql',
    [ATTR.dbCollection]: table,
    [ATTR.dbOperation]: operation,
    [ATTR.dbSummary]: summary,
    [ATTR.writeMethod]: method,
    [ATTR.fence]: fence.toString(),
  };
  return withSpan(t, summary, { kind: otel.SpanKind.CLIENT, attributes }, async (span) => {
    try {
      const result = await run();
      span?.setAttribute(ATTR.writeOutcome, result.status);
      if (result.status === 'stale' && result.currentFence !== undefined)
        span?.setAttribute(ATTR.currentFence, result.currentFence.toString());
      if (result.status !== 'applied')
        meter()?.refused.add(1, { [ATTR.dbCollection]: table, [ATTR.writeOutcome]: result.status });
      return result;
    } catch (err) {
      span?.setAttribute(ATTR.writeOutcome, 'error');
      if (span) failSpan(otel, span, err);
      throw err;
    } finally {
      span?.end();
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
  if (!otel) return run();
  const t = getTracer();
  if (!t && !meter()) return run();
  const summary = `UPDATE ${table}`;
  const attributes: Attributes | undefined = t && {
    [ATTR.dbSystem]: 'postgresql',
    [ATTR.dbCollection]: table,
    [ATTR.dbOperation]: 'UPDATE',
    [ATTR.dbSummary]: summary,
    [ATTR.writeMethod]: 'updateWhere',
    [ATTR.fence]: fence.toString(),
  };
  return withSpan(t, summary, { kind: otel.SpanKind.CLIENT, attributes }, async (span) => {
    try {
      const result = await run();
      span?.setAttributes({
        [ATTR.rowsApplied]: result.applied,
        [ATTR.rowsStale]: result.stale,
        [ATTR.writeOutcome]: result.stale === 0 ? 'applied' : result.applied === 0 ? 'stale' : 'partial',
      });
      if (result.stale > 0)
        meter()?.refused.add(result.stale, { [ATTR.dbCollection]: table, [ATTR.writeOutcome]: 'stale' });
      return result;
    } catch (err) {
      span?.setAttribute(ATTR.writeOutcome, 'error');
      if (span) failSpan(otel, span, err);
      throw err;
    } finally {
      span?.end();
    }
  });
}
