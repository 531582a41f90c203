/**
 * The README is a claim: every TypeScript block in it is type-checked (strict,
 * NodeNext, against palisade's sources) and run as written, in the harness
 * test/support/readme.ts gives it. A block without a harness fails the suite,
 * so a new snippet cannot go untested. This file runs the blocks that need no
 * embedded Postgres; test-slow/readme-pglite.test.ts runs the others. The
 * error table is checked against `ERROR_CODES`.
 */
import { execFile } from 'node:child_process';
import { rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ERROR_CLASSES, ERROR_CODES, type PalisadeErrorCode } from '../src/errors.js';
import { blocks, type Harness, harnesses, README, runBlock, startsPglite, writeBlocks } from './support/readme.js';
import { needs, services } from './support/services.js';

const run = promisify(execFile);

const dir = resolve('node_modules', '.cache', `palisade-readme-${process.pid}`);
let files = new Map<Harness, string>();
const admin = services.postgres.url ? postgres(services.postgres.url, { max: 1, onnotice: () => {} }) : undefined;
const databases: string[] = [];

beforeAll(() => {
  files = writeBlocks(dir);
});

afterAll(async () => {
  rmSync(dir, { recursive: true, force: true });
  for (const name of databases) await admin?.unsafe(`drop database if exists ${name} with (force)`);
  await admin?.end({ timeout: 5 });
});

describe('README', () => {
  it('every TypeScript block has exactly one harness, and every harness a block', () => {
    expect(blocks.length).toBeGreaterThanOrEqual(7);
    for (const block of blocks) {
      expect(harnesses.filter((h) => block.includes(h.marker)).map((h) => h.name)).toHaveLength(1);
    }
    for (const harness of harnesses) expect(blocks.filter((b) => b.includes(harness.marker))).toHaveLength(1);
  });

  it('every TypeScript block type-checks (strict, NodeNext)', { timeout: 180_000 }, async () => {
    const tsconfig = join(dir, 'tsconfig.json');
    writeFileSync(
      tsconfig,
      JSON.stringify({
        compilerOptions: {
          target: 'ES2022',
          module: 'NodeNext',
          moduleResolution: 'NodeNext',
          lib: ['ES2023', 'ES2024.String'], // as palisade's own tsconfig: its sources are checked too
          types: ['node'],
          strict: true,
          noUncheckedIndexedAccess: true,
          skipLibCheck: true,
          noEmit: true,
          allowImportingTsExtensions: true,
        },
        files: [...files.values()],
      }),
    );
    const tsc = resolve('node_modules/typescript/bin/tsc');
    const result = await run(process.execPath, [tsc, '-p', tsconfig], { timeout: 170_000 }).then(
      () => '',
      (err: { stdout?: string }) => err.stdout ?? String(err),
    );
    expect(result).toBe('');
  });

  it('the blocks that start an embedded PGlite are the ones the slow suite runs', () => {
    // The slow suite runs exactly these; this keeps the split visible when a block changes.
    expect(harnesses.filter(startsPglite).map((h) => h.name)).toEqual([
      'In twenty lines (PGlite)',
      'the LockManager interface',
      'migrate with an application folder',
      'palisade-db/testing',
      'lock scope',
      'fenced transactions',
      'the lock backend contract suite',
    ]);
  });

  for (const harness of harnesses.filter((h) => !startsPglite(h))) {
    const enabled = (harness.needs ?? []).every((variable) => needs(variable));
    it.runIf(enabled)(`"${harness.name}" runs as written`, { timeout: 180_000 }, async () => {
      const file = files.get(harness);
      expect(file).toBeDefined();
      expect(await runBlock(harness, file as string, admin, databases)).toEqual(harness.prints.split('\n'));
    });
  }

  it('the error table lists exactly the codes of ERROR_CODES, each once, with its class', () => {
    const section = README.slice(README.indexOf('## Errors'), README.indexOf('\n## ', README.indexOf('## Errors') + 5));
    const rows = [...section.matchAll(/^\| `([a-z_]+)` \| `([A-Za-z]+)` \|/gm)].map((m) => [m[1], m[2]]);
    expect(rows.map(([code]) => code).sort()).toEqual(Object.keys(ERROR_CODES).sort());
    expect(Object.keys(ERROR_CLASSES).sort()).toEqual(Object.keys(ERROR_CODES).sort());
    for (const [code, name] of rows) expect(name).toBe(ERROR_CLASSES[code as PalisadeErrorCode].name);
  });
});
