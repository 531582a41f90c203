/**
 * Settings shared by the property suites.
 *
 * Runs: each property has its own count (default 1000). `npm test` runs
 * every property at a fifth of its count (`PALISADE_PROPERTY_SCALE=0.2`, set in
 * vitest.config.ts); `npm run test:slow` runs test/property again at the full
 * counts. `PALISADE_PROPERTY_RUNS` sets `numRuns` of every property outright
 * (a long run: `PALISADE_PROPERTY_RUNS=20000 npx vitest run test/property`).
 *
 * Replaying a failure: fast-check prints `seed` and `path` (and, for
 * `fc.commands`, a `replayPath` in the counterexample). Re-run the one
 * failing file with
 *
 * ```sh
 * PALISADE_PROPERTY_SEED=<seed> PALISADE_PROPERTY_PATH=<path> npx vitest run test/property/<file>
 * ```
 *
 * and, for a commands property, `PALISADE_PROPERTY_REPLAY=<replayPath>` as
 * well. With a seed and path fast-check jumps straight to the shrunk
 * counterexample. Properties that talk to a database replay the same
 * sequence of calls; a database's own concurrency may still vary.
 */
import { fc } from '@fast-check/vitest';

/** `numRuns` for a property whose full count is `fallback`: `PALISADE_PROPERTY_RUNS`, else `fallback` times the scale. */
export function propertyRuns(fallback = 1000): number {
  const raw = process.env.PALISADE_PROPERTY_RUNS;
  if (raw === undefined || raw === '') return Math.max(1, Math.round(fallback * propertyScale()));
  const n = Number(raw);
  if (!Number.isSafeInteger(n) || n < 1)
    throw new Error(`PALISADE_PROPERTY_RUNS must be a positive integer, got ${raw}`);
  return n;
}

/** `PALISADE_PROPERTY_SCALE`: the share of each property's full count to run, in (0, 1]; default 1. */
function propertyScale(): number {
  const raw = process.env.PALISADE_PROPERTY_SCALE;
  if (raw === undefined || raw === '') return 1;
  const scale = Number(raw);
  if (!(scale > 0 && scale <= 1)) throw new Error(`PALISADE_PROPERTY_SCALE must be in (0, 1], got ${raw}`);
  return scale;
}

/** The run settings every property shares (no examples or reporters, so they fit any property's parameter type). */
export type PropertyParams = Pick<fc.Parameters<unknown>, 'numRuns' | 'verbose' | 'seed' | 'path' | 'endOnFailure'>;

/**
 * Parameters for `fc.assert` / `test.prop`: the run count, verbose failure
 * reports (seed, path, counterexample and the errors seen while shrinking),
 * and the replay variables when set.
 */
export function propertyParams(overrides: PropertyParams = {}): PropertyParams {
  const params: PropertyParams = { numRuns: propertyRuns(), verbose: fc.VerbosityLevel.Verbose, ...overrides };
  const seed = process.env.PALISADE_PROPERTY_SEED;
  const path = process.env.PALISADE_PROPERTY_PATH;
  if (seed) {
    params.seed = Number(seed);
    if (path) params.path = path;
  }
  return params;
}

/** Whether a failure is being replayed (`PALISADE_PROPERTY_SEED` set): a property then plays that seed alone. */
export function replaying(): boolean {
  return Boolean(process.env.PALISADE_PROPERTY_SEED);
}

/** `replayPath` for `fc.commands`, from `PALISADE_PROPERTY_REPLAY`. */
export function commandsReplayPath(): string | undefined {
  return process.env.PALISADE_PROPERTY_REPLAY || undefined;
}

/**
 * vitest timeout for one property: generous, because a property's run count
 * is fixed and the machine is shared. This bounds the test in time; it is
 * not an assertion about speed.
 */
export function propertyTimeout(msPerThousandRuns: number): number {
  return Math.max(60_000, Math.ceil((propertyRuns() / 1000) * msPerThousandRuns));
}
