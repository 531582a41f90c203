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
 * Longest first, each over ~25 s on a loaded 2-core machine: seconds per file in one `npm test`
 * (`vitest run --reporter=json`, 4 workers, this machine shared with another run; 2026-12-04).
 */
const LONG_FILES = [
  'test/fencing/contract.test.ts', // 145
  'test/fencing/advisory.test.ts', // 122
  'test/fencing/postgres.test.ts', // 111
  'test/cli/demo.test.ts', // 105
  'test/cli/migrate.test.ts', // 83
  'test/bad-input.test.ts', // 81
  'test/repo/lock-scope.test.ts', // 75
  'test/property/fenced-table.commands.test.ts', // 73
  'test/repo/lost-connection.test.ts', // 65
  'test/property/interleavings.test.ts', // 63
  'test/cli/fence-trigger.test.ts', // 52
  'test/chaos/chaos.test.ts', // 47
  'test/readme.test.ts', // 32
  'test/fencing/redis.test.ts', // 32
  'test/fencing/postgres-frozen.test.ts', // 29
  'test/property/tombstones.test.ts', // 28
  'test/fencing/bounded-waits.test.ts', // 28
  'test/fencing/redis-reset.test.ts', // 26
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
