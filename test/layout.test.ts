/**
 * Which way the imports run, and how long a file may grow (the README's
 * "Development" notes and issue 15): each lock backend lives in its own
 * folder under src/fencing/backends/ and imports no other backend; the core
 * (src/fencing outside backends/, src/repo, src/schema) imports no backend;
 * no file in src/ is over 400 lines.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { dirname, join, normalize, relative, sep } from 'node:path';
import { describe, expect, it } from 'vitest';

const MAX_LINES = 400;

/** Files other helpers are splitting; nothing may join this list. */
const LONG_FILE_EXEMPTIONS = new Set(['src/fencing/backends/redis/backend.ts', 'src/repo/repository.ts']);

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

  it(`no file in src/ is over ${MAX_LINES} lines (exempt: ${[...LONG_FILE_EXEMPTIONS].join(', ')})`, () => {
    const long = files
      .filter((file) => !LONG_FILE_EXEMPTIONS.has(file))
      .map((file) => ({ file, lines: readFileSync(file, 'utf8').split('\n').length - 1 }))
      .filter(({ lines }) => lines > MAX_LINES)
      .map(({ file, lines }) => `${relative('.', file)}: ${lines} lines`);
    expect(long).toEqual([]);
  });
});
