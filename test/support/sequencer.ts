/**
 * Starts the suite's longest files first. Without vitest's cache of earlier
 * durations (a clean clone, as in CI) files start largest-first by size, and a
 * short file that runs for half a minute or more (a chaos run, the README's
 * examples) could start last and end the run alone. The list is what `vitest --reporter=json`
 * measured; a file missing from it only loses its head start.
 */
import { relative } from 'node:path';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

/** Longest first, each over ~25 s on a loaded 2-core machine. */
const LONG_FILES = [
  'test/bad-input.test.ts',
  'test/cli/migrate.test.ts',
  'test/repo/lock-scope.test.ts',
  'test/property/fenced-table.commands.test.ts',
  'test/fencing/postgres.test.ts',
  'test/fencing/advisory.test.ts',
  'test/cli/demo.test.ts',
  'test/fencing/contract.test.ts',
  'test/repo/lost-connection.test.ts',
  'test/cli/fence-trigger.test.ts',
  'test/chaos/chaos.test.ts',
  'test/fencing/postgres-frozen.test.ts',
  'test/readme.test.ts',
  'test/property/tombstones.test.ts',
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
