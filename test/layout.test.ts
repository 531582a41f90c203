/**
 * Which way the imports run, and how long a file may grow (the README's
 * "Development" notes): each lock backend lives in its own
 * folder under src/fencing/backends/ and imports no other backend; the core
 * (src/fencing outside backends/, src/repo, src/schema) imports no backend;
 * no file in src/ is over 400 lines.
 */
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { dirname, join, normalize, relative, sep } from 'node:path';
import { describe, expect, it } from 'vitest';

const MAX_LINES = 400;

function sources(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return sources(path);
    return entry.name.endsWith('.ts') ? [path.split(sep).join('/')] : [];
  });
}

const files = sources('src');

/** The src/ files a file imports (relative imports only; packages are not ours). */
function importsOf(file: string): string[] {
  const text = readFileSync(file, 'utf8');
  const specifiers = [...text.matchAll(/(?:^|\n)\s*(?:import|export)\b[^;]*?\bfrom\s+'(\.[^']+)'/g)].map((m) => m[1]);
  const dynamic = [...text.matchAll(/\bimport\(\s*'(\.[^']+)'\s*\)/g)].map((m) => m[1]);
  return [...specifiers, ...dynamic].map((spec) =>
    normalize(join(dirname(file), (spec as string).replace(/\.js$/, '.ts')))
      .split(sep)
      .join('/'),
  );
}

/** `redis` for src/fencing/backends/redis/…, undefined outside the backends. */
function backendOf(file: string): string | undefined {
  return /^src\/fencing\/backends\/([^/]+)\//.exec(file)?.[1];
}

const isCore = (file: string) =>
  (file.startsWith('src/fencing/') && backendOf(file) === undefined) ||
  file.startsWith('src/repo/') ||
  file.startsWith('src/schema/');

describe('layout', () => {
  it('finds the sources, the backends and the core', () => {
    expect(files.filter((f) => backendOf(f) !== undefined).length).toBeGreaterThan(4);
    expect(files.filter(isCore).length).toBeGreaterThan(4);
    expect(importsOf('src/backend.ts')).toContain('src/fencing/lock-manager.ts');
    expect(new Set(files.map(backendOf).filter(Boolean))).toEqual(
      new Set(['etcd', 'postgres-advisory', 'postgres-lease', 'redis']),
    );
  });

  it('no backend imports another backend', () => {
    const crossings = files.flatMap((file) => {
      const own = backendOf(file);
      if (!own) return [];
      return importsOf(file)
        .filter((target) => backendOf(target) !== undefined && backendOf(target) !== own)
        .map((target) => `${file} → ${target}`);
    });
    expect(crossings).toEqual([]);
  });

  it('the core (src/fencing outside backends/, src/repo, src/schema) imports no backend', () => {
    const uphill = files.filter(isCore).flatMap((file) =>
      importsOf(file)
        .filter((target) => backendOf(target) !== undefined)
        .map((target) => `${file} → ${target}`),
    );
    expect(uphill).toEqual([]);
  });

  it(`no file in src/ is over ${MAX_LINES} lines`, () => {
    const long = files
      .map((file) => ({ file, lines: readFileSync(file, 'utf8').split('\n').length - 1 }))
      .filter(({ lines }) => lines > MAX_LINES)
      .map(({ file, lines }) => `${relative('.', file)}: ${lines} lines`);
    expect(long).toEqual([]);
  });

  it("the test sequencer's list of long files names files that exist", () => {
    // Read as text: the sequencer imports vitest's runner, which a test need not load.
    const text = readFileSync('test/support/sequencer.ts', 'utf8');
    const listed = [...text.matchAll(/^ {2}'(test\/[^']+\.test\.ts)',/gm)].map((m) => m[1] as string);
    expect(listed.length).toBeGreaterThan(10);
    expect(listed.filter((file) => !existsSync(file))).toEqual([]);
  });
});
