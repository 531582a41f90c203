/**
 * How a test starts one of this repository's TypeScript programs (the CLI, a
 * worker, a fixture) as a separate OS process.
 *
 * The suite starts about 140 of them, and `node --import tsx` costs each
 * one more CPU than plain JavaScript (its loader resolves and transforms
 * every module of the graph): the CLI's `--help` 1.1 against 0.3 s, the 32
 * CLI runs of test/cli/migrate.test.ts 57 against 42 s — a minute of CPU
 * per `npm test` on two cores. So the global setup transforms the
 * repository's TypeScript once per run into a directory of plain JavaScript
 * laid out as the sources are (esbuild, the transform tsx itself applies, with
 * `palisade-db` imports pointed at the transformed sources), and children run
 * that. Paths a program derives from its own location (`../drizzle`,
 * `../../package.json`, a worker beside it) resolve there through links to
 * the originals; the working directory stays the repository root.
 */
import { mkdirSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { transformSync } from 'esbuild';

/** The variable that names this run's directory of transformed programs. */
const VARIABLE = 'PALISADE_TEST_JS';

/** What is transformed: every program a test may start, with everything it imports from the repository. */
const SOURCES = ['src', 'test', 'examples', 'scripts'];
/** Linked, not transformed: what programs read beside their own files. */
const LINKED = ['drizzle', 'package.json'];

/**
 * The package's own entries (`palisade-db`, `palisade-db/testing`, …) → their sources (`src/….ts`, relative
 * to `root`), from package.json's `exports`: how code in this repository imports the package as a user does.
 */
export function packageEntries(root: string): Map<string, string> {
  const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as {
    name: string;
    exports: Record<string, string | { default?: string }>;
  };
  const paths = new Map<string, string>();
  for (const [entry, target] of Object.entries(pkg.exports)) {
    const built = typeof target === 'string' ? target : target.default;
    if (!built?.startsWith('./dist/')) continue; // ./package.json
    paths.set(`${pkg.name}${entry.slice(1)}`, built.replace('./dist/', 'src/').replace(/\.js$/, '.ts'));
  }
  return paths;
}

/** The node arguments that run `script` (a `.ts` path relative to the repository root) in a child. */
export function programArgs(script: string): string[] {
  const dir = process.env[VARIABLE];
  if (!dir) throw new Error(`${VARIABLE} is not set: the vitest configs' global setup builds the programs`);
  return [join(dir, script.replace(/\.ts$/, '.js'))];
}

/** Transforms the repository's TypeScript into a fresh directory and names it for this run's processes. */
export function buildPrograms(root: string): () => void {
  const dir = resolve(root, 'node_modules', '.cache', `palisade-test-js-${process.pid}`);
  rmSync(dir, { recursive: true, force: true });
  const entries = packageEntries(root);
  const walk = (from: string) => {
    for (const entry of readdirSync(join(root, from), { withFileTypes: true })) {
      const path = join(from, entry.name);
      if (entry.isDirectory()) {
        if (entry.name !== 'node_modules' && !entry.name.startsWith('.')) walk(path);
      } else if (entry.name.endsWith('.ts') && !entry.name.endsWith('.d.ts') && !entry.name.endsWith('.test.ts')) {
        emit(path);
      }
    }
  };
  const emit = (path: string) => {
    const out = join(dir, path.replace(/\.ts$/, '.js'));
    const { code } = transformSync(readFileSync(join(root, path), 'utf8'), {
      loader: 'ts',
      format: 'esm',
      target: 'node20',
      sourcefile: path,
      tsconfigRaw: { compilerOptions: { verbatimModuleSyntax: true } },
    });
    const pointed = code.replace(/from "([^"]+)"/g, (whole, name: string) => {
      const target = entries.get(name);
      return target ? `from ${JSON.stringify(join(dir, target.replace(/\.ts$/, '.js')))}` : whole;
    });
    mkdirSync(dirname(out), { recursive: true });
    writeFileSync(out, pointed);
  };
  for (const from of SOURCES) walk(from);
  for (const name of LINKED) symlinkSync(join(root, name), join(dir, name));
  process.env[VARIABLE] = dir;
  return () => rmSync(dir, { recursive: true, force: true });
}
