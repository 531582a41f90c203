/**
 * How a test starts an in-memory PGlite.
 *
 * A `new PGlite()` runs initdb in WebAssembly first: 3–5 s of CPU on this
 * 2-core machine, 13 s while the suite's other workers run, and the suite
 * starts about 30 of them. A PGlite started from the data directory of a
 * fresh one (`loadDataDir`) skips initdb and is ready in about a second
 * (`new PGlite()` 13.4 s against 2.5 s, measured side by side under load).
 * So the global setup saves the data directory of one fresh PGlite, and
 * every test's PGlite starts from that copy: the same empty cluster a
 * `new PGlite()` builds, a separate in-memory instance each time. The copy is
 * kept between runs, one per PGlite version (a new version initdb's anew).
 */
import { existsSync, mkdirSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { PGlite } from '@electric-sql/pglite';

/** The variable that names the saved data directory of a fresh PGlite (a tar file). */
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

/**
 * Names this run's copy of a fresh PGlite's data directory for the tests, first saving it if this PGlite
 * version has none yet (written aside, then renamed: a run that sees the file sees all of it).
 */
export async function preparePglite(root: string): Promise<void> {
  const modules = resolve(root, 'node_modules');
  const { version } = JSON.parse(readFileSync(join(modules, '@electric-sql', 'pglite', 'package.json'), 'utf8')) as {
    version: string;
  };
  const dir = join(modules, '.cache', 'palisade-test-pglite');
  const file = join(dir, `fresh-${version}.tar`);
  if (!existsSync(file)) {
    mkdirSync(dir, { recursive: true });
    const fresh = new PGlite();
    try {
      await fresh.waitReady;
      const data = await fresh.dumpDataDir('none');
      const partial = `${file}.${process.pid}`;
      writeFileSync(partial, Buffer.from(await data.arrayBuffer()));
      renameSync(partial, file);
    } finally {
      await fresh.close();
    }
  }
  process.env[VARIABLE] = file;
}
