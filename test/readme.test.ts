import { execFile } from 'node:child_process';
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';

const run = promisify(execFile);

/** The README's first example is a claim: run it as written, on embedded PGlite. */
describe('README', () => {
  it('"In twenty lines" runs as written and its write applies', async () => {
    const readme = readFileSync('README.md', 'utf8');
    const section = readme.slice(readme.indexOf('## In twenty lines'));
    const code = /```ts\n([\s\S]*?)```/.exec(section)?.[1];
    expect(code).toBeDefined();
    // Inside the repository, so its imports resolve from our node_modules.
    const dir = join('node_modules', '.cache', `palisade-readme-${process.pid}`);
    mkdirSync(dir, { recursive: true });
    const file = join(dir, 'example.mts');
    writeFileSync(file, (code as string).replace("from 'palisade-db'", `from '${resolve('src/index.ts')}'`));
    try {
      const { stdout } = await run(process.execPath, ['--import', 'tsx', file], { timeout: 120_000 });
      expect(stdout.trim()).toBe('applied');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
