/**
 * The published `palisade` bin is the compiled `dist/cli/main.js`: after
 * `npm run build` it runs with plain node — no tsx — including the demo,
 * whose worker processes are then compiled files too.
 */
import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';

function run(command: string, args: string[], env: NodeJS.ProcessEnv, timeoutMs: number) {
  const child = spawn(command, args, { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (c) => {
    stdout += String(c);
  });
  child.stderr.on('data', (c) => {
    stderr += String(c);
  });
  return new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`${command} ${args.join(' ')}: still running after ${timeoutMs} ms; ${stdout} ${stderr}`));
    }, timeoutMs);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

describe('the palisade bin (npm run build → dist/cli/main.js)', () => {
  it('is declared in package.json, builds, and runs --help and the demo without tsx', {
    timeout: 300_000,
  }, async () => {
    const pkg = JSON.parse(readFileSync('package.json', 'utf8')) as { bin?: Record<string, string>; files?: string[] };
    expect(pkg.bin).toEqual({ palisade: './dist/cli/main.js' });
    // The full list is test/package/files.snapshot.txt (npm run test:package).
    expect(pkg.files).toEqual(expect.arrayContaining(['dist', 'drizzle/*.sql', 'drizzle/meta/_journal.json']));

    const build = await run('npm', ['run', '--silent', 'build'], process.env, 240_000);
    expect({ code: build.code, out: build.stdout + build.stderr }).toEqual({ code: 0, out: '' });
    expect(readFileSync('dist/cli/main.js', 'utf8').startsWith('#!/usr/bin/env node\n')).toBe(true);

    // No tsx anywhere: NODE_OPTIONS cleared, plain node on the compiled files.
    const env: NodeJS.ProcessEnv = { ...process.env, NODE_OPTIONS: '' };
    delete env.DATABASE_URL;
    delete env.REDIS_URL;
    const help = await run(process.execPath, ['dist/cli/main.js', '--help'], env, 60_000);
    expect(help.code).toBe(0);
    expect(help.stdout).toMatch(/^Usage: palisade <command>/);
    expect(help.stdout).toMatch(/palisade \d+\.\d+\.\d+ —/);

    const demo = await run(process.execPath, ['dist/cli/main.js', 'demo'], env, 120_000);
    expect({ code: demo.code, stderr: demo.stderr }).toEqual({ code: 0, stderr: '' });
    expect(demo.stdout).toMatch(/REFUSED by Postgres: stale/);
    expect(demo.stdout).toMatch(/result: visits = 2 after two increments — right/);
  });
});
