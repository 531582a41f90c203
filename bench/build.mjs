// `npm run bench` runs the benchmark compiled by tsc, as the library is published (dist/ is tsc's
// output too), not through tsx: tsx compiles with esbuild's keepNames, which wraps every function
// created at run time in a name-setting call — a few µs per repository write or lock cycle that
// users never pay, and that the peers (plain JavaScript in node_modules) are spared.
import { execFileSync } from 'node:child_process';
import { rmSync, symlinkSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const out = join(root, '.bench-build');
rmSync(out, { recursive: true, force: true });
execFileSync(join(root, 'node_modules', '.bin', 'tsc'), ['-p', join(root, 'bench', 'tsconfig.json')], {
  stdio: 'inherit',
});
// src/migrate.js finds palisade's migrations beside it, at ../drizzle.
symlinkSync(join(root, 'drizzle'), join(out, 'drizzle'), 'dir');
