/**
 * Starts the suite's longest files first. Without vitest's cache of earlier
 * durations (a clean clone, as in CI) files start largest-first by size, and a
 * short file that runs for half a minute or more (a chaos run, the README's
 * examples) could start last and end the run alone. The list is what CI's runs measured (each file's
 * duration, as vitest reports it); a file missing from it only loses its head start.
 */
import { relative } from 'node:path';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

/**
 * Longest first, each over ~14 s on a loaded 2-core machine: seconds per file, the mean of two CI runs of
 * `npm test` (4 workers; 2026-12-06, 344 and 274 s wall). The list of 2026-12-05 no longer named the
 * longest file first (test/repo/lost-connection.test.ts, 44 s then, 64 s now).
 * test/layout.test.ts checks that every entry exists.
 */
const LONG_FILES = [
  'test/repo/lost-connection.test.ts', // 64
  'test/fencing/contract.test.ts', // 53
  'test/repo/lost-lease.test.ts', // 51
  'test/repo/lock-scope.test.ts', // 51
  'test/bad-input.test.ts', // 50
  'test/cli/demo.test.ts', // 44
  'test/fencing/redis.test.ts', // 43
  'test/fencing/postgres.test.ts', // 40
  'test/fencing/advisory.test.ts', // 39
  'test/repo/aborted-commit.test.ts', // 32
  'test/cli/migrate.test.ts', // 32
  'test/property/overlapping-calls.test.ts', // 29
  'test/fencing/postgres-frozen.test.ts', // 25
  'test/repo/near-expiry.test.ts', // 24
  'test/property/fenced-table.commands.test.ts', // 23
  'test/readme.test.ts', // 22
  'test/fencing/bounded-waits.test.ts', // 22
  'test/property/interleavings.test.ts', // 20
  'test/fencing/redis-reset.test.ts', // 20
  'test/fencing/redis-handoff.test.ts', // 18
  'test/property/update-plan.prop.test.ts', // 16
  'test/property/source-change.test.ts', // 16
  'test/schema/stalled-sharers.test.ts', // 15
  'test/repo/table-identity.test.ts', // 15
  'test/property/tombstones.test.ts', // 15
  'test/fencing/source.test.ts', // 15
  'test/fencing/redis-processes.test.ts', // 15
  'test/fencing/redis-cluster.test.ts', // 15
  'test/repo/eager-claim.test.ts', // 14
  'test/fencing/lock-manager.test.ts', // 14
];

export class LongestFirstSequencer extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const sorted = await super.sort(files);
    const rank = (f: TestSpecification) => {
      const i = LONG_FILES.indexOf(relative(this.ctx.config.root, f.moduleId).split('\\').join('/'));
      return i === -1 ? LONG_FILES.length : i;
    };
    // Array.prototype.sort is stable: the other files keep the base order.
    return sorted.sort((a, b) => rank(a) - rank(b));
  }
}
