/**
 * The README blocks that start an embedded PGlite, run as written (seconds of
 * CPU each, so here rather than in `npm test`; test/readme.test.ts type-checks
 * them and runs the rest). The harnesses are in test/support/readme.ts.
 */
import { rmSync } from 'node:fs';
import { resolve } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Harness, harnesses, runBlock, startsPglite, writeBlocks } from '../test/support/readme.js';

const dir = resolve('node_modules', '.cache', `palisade-readme-pglite-${process.pid}`);
let files = new Map<Harness, string>();

beforeAll(() => {
  files = writeBlocks(dir);
});

afterAll(() => {
  rmSync(dir, { recursive: true, force: true });
});

describe('README blocks on PGlite', () => {
  const pglite = harnesses.filter(startsPglite);

  it('there are such blocks, none of which needs a service', () => {
    expect(pglite.length).toBeGreaterThan(0);
    for (const harness of pglite) expect(harness.needs ?? []).toEqual([]);
  });

  for (const harness of pglite) {
    it(`"${harness.name}" runs as written`, { timeout: 180_000 }, async () => {
      const file = files.get(harness);
      expect(file).toBeDefined();
      expect(await runBlock(harness, file as string, undefined, [])).toEqual(harness.prints.split('\n'));
    });
  }
});
