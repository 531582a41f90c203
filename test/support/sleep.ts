/** The one plain sleep of tests, bench and scripts (src keeps its own: it cannot import test code). */

/** Resolves after `ms` milliseconds; never rejects. */
export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
