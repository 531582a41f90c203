/**
 * The public surface, pinned: every name each package entry exports (types
 * marked `type`), sorted, against the committed `exports.snapshot.txt`. A
 * name that appears or disappears fails here until the snapshot — and the
 * README's changelog — say so (`npx vitest run test/exports.test.ts -u`).
 */
import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import ts from 'typescript';
import { describe, expect, it } from 'vitest';

const pkg = JSON.parse(readFileSync('package.json', 'utf8')) as { exports: Record<string, unknown> };

/** Each entry of package.json's `exports` and the source it is built from. */
const ENTRIES: Readonly<Record<string, string>> = {
  '.': 'src/index.ts',
  './testing': 'src/testing/index.ts',
  './backend': 'src/backend.ts',
  './etcd': 'src/fencing/backends/etcd/index.ts',
};

function surface(): string {
  const files = Object.values(ENTRIES).map((file) => resolve(file));
  const program = ts.createProgram(files, {
    target: ts.ScriptTarget.ES2022,
    module: ts.ModuleKind.NodeNext,
    moduleResolution: ts.ModuleResolutionKind.NodeNext,
    strict: true,
    skipLibCheck: true,
    noEmit: true,
  });
  const checker = program.getTypeChecker();
  const sections: string[] = [];
  for (const [entry, file] of Object.entries(ENTRIES)) {
    const source = program.getSourceFile(resolve(file));
    const module = source && checker.getSymbolAtLocation(source);
    if (!module) throw new Error(`no module symbol for ${file}`);
    const names = checker.getExportsOfModule(module).map((symbol) => {
      const target = symbol.flags & ts.SymbolFlags.Alias ? checker.getAliasedSymbol(symbol) : symbol;
      return target.flags & ts.SymbolFlags.Value ? symbol.name : `type ${symbol.name}`;
    });
    const sorted = names.sort((a, b) => a.replace(/^type /, '').localeCompare(b.replace(/^type /, ''), 'en'));
    sections.push(`# palisade-db${entry.slice(1)}\n${sorted.join('\n')}\n`);
  }
  return sections.join('\n');
}

describe('public exports', () => {
  it('the entries are the package.json exports (besides package.json)', () => {
    expect(Object.keys(pkg.exports).filter((entry) => entry !== './package.json')).toEqual(Object.keys(ENTRIES));
  });

  it('each entry exports exactly the names of the snapshot', { timeout: 60_000 }, async () => {
    await expect(surface()).toMatchFileSnapshot('./exports.snapshot.txt');
  });

  it('no entry re-exports a whole module (`export *`)', () => {
    for (const file of Object.values(ENTRIES)) expect(readFileSync(file, 'utf8'), file).not.toMatch(/^export \*/m);
  });
});
