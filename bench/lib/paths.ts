/**
 * Where the benchmark's files are, whether it runs compiled (`npm run
 * bench`: tsc's output in .bench-build/, see bench/build.mjs) or from
 * source (`node --import tsx bench/run.ts`).
 */
import { basename, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const top = fileURLToPath(new URL('../..', import.meta.url));

/** True when this is tsc's output, not the TypeScript source. */
export const COMPILED = import.meta.url.endsWith('.js');

/** The repository's root (package.json, node_modules). */
export const ROOT = basename(top) === '.bench-build' ? dirname(top) : top;

/** Where the results files are written: bench/results/ of the repository, never of the build. */
export const RESULTS = join(ROOT, 'bench', 'results');
