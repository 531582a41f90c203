import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vitest/config';
import { LongestFirstSequencer } from './test/support/sequencer.js';

// The package's own name resolves to its sources (as tsconfig.json's `paths` do for tsc and tsx),
// so examples and tests import `palisade-db` exactly as a user does.
const source = (path: string) => fileURLToPath(new URL(path, import.meta.url));

export default defineConfig({
  resolve: {
    alias: [
      { find: /^palisade-db$/, replacement: source('./src/index.ts') },
      { find: /^palisade-db\/testing$/, replacement: source('./src/testing/index.ts') },
      { find: /^palisade-db\/backend$/, replacement: source('./src/backend.ts') },
      { find: /^palisade-db\/etcd$/, replacement: source('./src/fencing/backends/etcd/index.ts') },
    ],
  },
  test: {
    include: ['test/**/*.test.ts'],
    globalSetup: ['test/support/global-setup.ts'],
    // PGlite takes seconds to start on a busy 2-core machine; fault tests wait on real TTLs.
    testTimeout: 60_000,
    hookTimeout: 120_000,
    pool: 'forks',
    // A worker process runs file after file without reloading the modules: each file's imports cost 2–3 s of
    // CPU on this machine, 170 s of a run's 1,300 (2026-12-05, same order: 376 s wall isolated, 332 s not).
    // Tests share no state through modules (each opens its own databases, key prefixes and SDKs) but the
    // process's one deadline timer, whose tests count only the deadlines they scheduled (a lease an earlier
    // file left to expire may still be pending: test/fencing/deadlines.test.ts).
    isolate: false,
    // Four files at once on this 2-core machine: the whole suite took 335–364 s wall with 4, 319–389 s with 3 and
    // 384 s with 2 (2026-12-04: warm and cold caches, CI runs; no worker count won beyond the runs' spread).
    maxWorkers: 4,
    // Every property at a fifth of its count here (at half, the suite took 371–414 s wall, over its 6 minutes;
    // at 30%, 355–380 s; at a quarter, 349–420 s); `npm run test:slow` runs them at the full counts
    // (test/property/support.ts).
    env: { PALISADE_PROPERTY_SCALE: process.env.PALISADE_PROPERTY_SCALE ?? '0.2' },
    sequence: { sequencer: LongestFirstSequencer },
  },
});
