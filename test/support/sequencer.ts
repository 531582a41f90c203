/**
 * Starts the suite's longest files first. Without vitest's cache of earlier
 * durations (a clean clone, as in CI) files start largest-first by size, and a
 * short file that runs for half a minute or more (a chaos run, the README's
 * examples) could start last and end the run alone. The list is what `vitest --reporter=json`
 * measured; a file missing from it only loses its head start.
 */
import { relative } from 'node:path';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

/**
 * Longest first, each over ~15 s on a loaded 2-core machine: seconds per file, the mean of two
 * `npm test` runs (`vitest run --reporter=json`, 4 workers; 2026-12-05). Packed this way the two runs
 * would have ended near 300 and 325 s, against the 398 and 427 s they took in the order of the list before,
 * which no longer named the three longest files. test/layout.test.ts checks that every entry exists.
 */
const LONG_FILES = [
  'test/repo/aborted-commit.test.ts', // 91
  'test/repo/lock-scope.test.ts', // 72
  'test/repo/lost-lease.test.ts', // 66
  'test/cli/migrate.test.ts', // 60
  'test/fencing/postgres.test.ts', // 55
  'test/fencing/advisory.test.ts', // 54
  'test/fencing/contract.test.ts', // 51
  'test/cli/demo.test.ts', // 46
  'test/property/overlapping-calls.test.ts', // 46
  'test/bad-input.test.ts', // 46
  'test/repo/lost-connection.test.ts', // 44
  'test/fencing/redis.test.ts', // 42
  'test/property/fenced-table.commands.test.ts', // 39
  'test/property/interleavings.test.ts', // 38
  'test/fencing/postgres-frozen.test.ts', // 26
  'test/readme.test.ts', // 26
  'test/fencing/redis-reset.test.ts', // 25
  'test/fencing/bounded-waits.test.ts', // 23
  'test/cli/fence-trigger.test.ts', // 22
  'test/repo/eager-claim.test.ts', // 20
  'test/property/lost-lease.test.ts', // 20
  'test/fencing/redis-handoff.test.ts', // 20
  'test/examples/telemetry.test.ts', // 19
  'test/fencing/redis-history.test.ts', // 18
  'test/fencing/redis-processes.test.ts', // 18
  'test/property/idle-bound.test.ts', // 18
  'test/examples/backfill.test.ts', // 16
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
