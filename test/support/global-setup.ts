import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { preparePglite } from './pglite.js';
import { buildPrograms } from './programs.js';
import { binaries, services } from './services.js';
import { prepareTemplate } from './template-database.js';

// Suites mark what they need with `needs('DATABASE_URL')` / `needs('REDIS_URL')`, or a binary: `needs('ETCD')`.
function suitesNeeding(variable: string): string[] {
  const found: string[] = [];
  const walk = (dir: string) => {
    for (const entry of readdirSync(dir, { withFileTypes: true })) {
      const path = join(dir, entry.name);
      if (entry.isDirectory()) walk(path);
      else if (entry.name.endsWith('.test.ts') && readFileSync(path, 'utf8').includes(`needs('${variable}')`))
        found.push(path);
    }
  };
  walk('test');
  return found.sort();
}

/**
 * In CI every service must be configured; elsewhere, name each suite that will skip. Then the programs
 * tests start in child processes are transformed once (./programs.ts); the teardown removes them. The tests'
 * PGlites start from a fresh one's data directory, saved once per PGlite version (./pglite.ts); on the real
 * Postgres a migrated template is made for the run (./template-database.ts), and dropped by the teardown.
 */
export default async function setup(): Promise<() => Promise<void>> {
  for (const service of Object.values(services)) {
    if (service.url) continue;
    if (process.env.CI) {
      throw new Error(`CI=true but ${service.variable} is not set: .ci/run must start the service and export it`);
    }
    const suites = suitesNeeding(service.variable);
    if (suites.length > 0) {
      console.warn(`skipped (set ${service.variable} to run them): ${suites.join(', ')}`);
    }
  }
  for (const [name, program] of Object.entries(binaries)) {
    if (program.path) continue;
    if (process.env.CI) {
      throw new Error(`CI=true but ${program.binary} is not on PATH: .ci/run must install ${program.debianPackage}`);
    }
    const suites = suitesNeeding(name);
    if (suites.length > 0) {
      console.warn(`skipped (install ${program.debianPackage} to run them): ${suites.join(', ')}`);
    }
  }
  await preparePglite(process.cwd());
  const dropTemplate = services.postgres.url ? await prepareTemplate(services.postgres.url) : undefined;
  const removePrograms = buildPrograms(process.cwd());
  return async () => {
    removePrograms();
    await dropTemplate?.();
  };
}
