/**
 * The real services a suite may need, each enabled by one variable. Without
 * it the suite is skipped (named once by test/support/global-setup.ts); in
 * CI (CI=true) a missing service fails the run instead.
 */
import { accessSync, constants } from 'node:fs';
import { delimiter, join } from 'node:path';

export const services = {
  postgres: { variable: 'DATABASE_URL', url: process.env.DATABASE_URL },
  redis: { variable: 'REDIS_URL', url: process.env.REDIS_URL },
} as const;

/**
 * Programs a suite starts itself (a cluster of its own on loopback ports),
 * by the name `needs()` takes: present when the binary is on PATH. Like a
 * service, a missing one skips its suites locally and fails the run in CI.
 */
export const binaries = {
  ETCD: { binary: 'etcd', debianPackage: 'etcd-server', path: onPath('etcd') },
  REDIS_SERVER: { binary: 'redis-server', debianPackage: 'redis-server', path: onPath('redis-server') },
} as const;

export type BinaryName = keyof typeof binaries;

/**
 * Marks a suite as needing a service: returns true when it is configured.
 * Use as `describe.runIf(needs('DATABASE_URL'))(…)`; global-setup names
 * the skipped suites from these calls.
 */
export function needs(variable: 'DATABASE_URL' | 'REDIS_URL' | BinaryName): boolean {
  if (variable in binaries) return binaries[variable as BinaryName].path !== undefined;
  return Boolean(process.env[variable]);
}

/** The full path of an executable `name` on PATH, or undefined. */
function onPath(name: string): string | undefined {
  for (const dir of (process.env.PATH ?? '').split(delimiter)) {
    if (!dir) continue;
    const full = join(dir, name);
    try {
      accessSync(full, constants.X_OK);
      return full;
    } catch {
      // not here
    }
  }
  return undefined;
}
