/**
 * How a test starts an in-memory PGlite.
 *
 * A `new PGlite()` runs initdb in WebAssembly first: 3–5 s of CPU on this
 * 2-core machine, 13 s while the suite's other workers run, and the suite
 * starts about 30 of them. A PGlite started from the data directory of a
 * fresh one (`loadDataDir`) skips initdb and is ready in about a second
 * (`new PGlite()` 13.4 s against 2.5 s, measured side by side under load).
 * So the global setup starts one fresh PGlite per run, before anything
 * touches it, and saves its data directory; every test's PGlite starts from
 * that copy: the same empty cluster a `new PGlite()` builds, a separate
 * in-memory instance each time.
 */
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { PGlite } from '@electric-sql/pglite';

/** The variable that names this run's saved data directory of a fresh PGlite. */
const VARIABLE = 'PALISADE_TEST_PGLITE';

/**
 * A new in-memory PGlite, empty as `new PGlite()` leaves it. Started from the global setup's copy when there
 * is one (every vitest config of this repository has it); otherwise it runs initdb itself.
 */
export function newPglite(): PGlite {
  const file = process.env[VARIABLE];
  if (!file) return new PGlite();
  return new PGlite({ loadDataDir: new Blob([readFileSync(file)]) });
}

/** Starts one fresh PGlite, saves its data directory for this run's tests and names it; the teardown removes it. */
export async function preparePglite(root: string): Promise<() => void> {
  const dir = resolve(root, 'node_modules', '.cache', `palisade-test-pglite-${process.pid}`);
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  const fresh = new PGlite();
  try {
    await fresh.waitReady;
    const data = await fresh.dumpDataDir('none');
    const file = join(dir, 'fresh.tar');
    writeFileSync(file, Buffer.from(await data.arrayBuffer()));
    process.env[VARIABLE] = file;
  } finally {
    await fresh.close();
  }
  return () => rmSync(dir, { recursive: true, force: true });
}
