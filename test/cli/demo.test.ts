/**
 * `npm run demo` — the README's first command — runs with no configuration
 * (embedded PGlite shared over a unix socket by separate worker processes)
 * and tells the story: the lock without a fence loses an update; palisade
 * refuses the stale write and keeps the counter right. With DATABASE_URL /
 * REDIS_URL it runs on those servers instead.
 */
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import postgres from 'postgres';
import { afterEach, describe, expect, it } from 'vitest';
import { type CliRun, killAllCli, runCli } from '../support/cli.js';
import { postgresDatabase } from '../support/databases.js';
import { needs } from '../support/services.js';

afterEach(killAllCli);

function npmRunDemo(env: Record<string, string | undefined>, timeoutMs = 120_000): Promise<CliRun> {
  const merged: NodeJS.ProcessEnv = { ...process.env };
  for (const [k, v] of Object.entries(env)) {
    if (v === undefined) delete merged[k];
    else merged[k] = v;
  }
  const child = spawn('npm', ['run', '--silent', 'demo'], { env: merged, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (c) => {
    stdout += String(c);
  });
  child.stderr.on('data', (c) => {
    stderr += String(c);
  });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`npm run demo still running after ${timeoutMs} ms; stdout: ${stdout}; stderr: ${stderr}`));
    }, timeoutMs);
    child.on('close', (code) => {
      clearTimeout(timer);
      resolve({ code, stdout, stderr });
    });
  });
}

/** The story's key lines, in order. */
function expectStory(run: CliRun) {
  expect({ code: run.code, stderr: run.stderr }).toEqual({ code: 0, stderr: '' });
  const out = run.stdout;
  const lines = [
    /Act 1 — a correct TTL lock/,
    /A {2}read visits = 0; will write 1/,
    /⏸ {2}A paused \(SIGSTOP\)/,
    /B {2}took the lock "counter": A's lease had expired while A was paused/,
    /A {2}wrote visits = 1 — it landed: nothing checked that A still held the lock/,
    /result: visits = 1 after two increments — expected 2\. B's increment was lost\./,
    /Act 2 — palisade/,
    /A {2}took the lock "counter" with fence (\d+)/,
    /B {2}took the lock "counter" with fence (\d+): A's lease had expired/,
    /A {2}wrote visits = 1 with fence (\d+) — REFUSED by Postgres: stale \(the row carries fence (\d+)\)/,
    /result: visits = 2 after two increments — right/,
    /palisade {14}visits = 2 after 2 increments {2}✓/,
  ];
  let from = 0;
  for (const line of lines) {
    const rest = out.slice(from);
    const m = line.exec(rest);
    expect(m, `expected ${line} after: ${rest}`).not.toBeNull();
    from += (m?.index ?? 0) + (m?.[0].length ?? 0);
  }
  const aFence = BigInt(/A {2}took the lock "counter" with fence (\d+)/.exec(out)?.[1] ?? '0');
  const bFence = BigInt(/B {2}took the lock "counter" with fence (\d+)/.exec(out)?.[1] ?? '0');
  const refused = /with fence (\d+) — REFUSED by Postgres: stale \(the row carries fence (\d+)\)/.exec(out);
  expect(bFence).toBeGreaterThan(aFence);
  expect(refused?.slice(1)).toEqual([String(aFence), String(bFence)]);
  // The workers were real, separate processes, and none is left behind (not even a stopped one).
  const pids = /worker A is pid (\d+), worker B is pid (\d+)/.exec(out)?.slice(1).map(Number) ?? [];
  expect(pids).toHaveLength(2);
  for (const pid of pids) {
    expect(pid).not.toBe(process.pid);
    expect(() => process.kill(pid, 0)).toThrow();
  }
}

describe('npm run demo (no configuration: embedded PGlite)', () => {
  it('tells the story and exits 0, leaving no worker and no socket behind', { timeout: 180_000 }, async () => {
    const run = await npmRunDemo({ DATABASE_URL: undefined, REDIS_URL: undefined });
    expect(run.stdout).toMatch(/database: embedded PGlite, served to the worker processes on the unix socket \//);
    expect(run.stdout).toMatch(/locks: {4}Postgres leases \(palisade\.leases\); palisade fences from the sequence/);
    expectStory(run);
    const socket = /on the unix socket (\S+)/.exec(run.stdout)?.[1] ?? '';
    expect(socket).toMatch(/\.s\.PGSQL\.5432$/);
    expect(existsSync(socket)).toBe(false);
  });
});

describe.runIf(needs('DATABASE_URL'))('palisade demo on DATABASE_URL (real Postgres)', () => {
  it('says so, tells the same story, and drops its temporary schema', { timeout: 180_000 }, async () => {
    const test = await postgresDatabase();
    try {
      const run = await runCli(['demo'], { DATABASE_URL: test.url, REDIS_URL: undefined }, 120_000);
      expect(run.stdout).toMatch(/database: the Postgres at DATABASE_URL \(127\.0\.0\.1:\d+\/palisade_t_\w+\)/);
      expectStory(run);
      const schema = /temporary schema (palisade_demo_\w+)/.exec(run.stdout)?.[1];
      expect(schema).toBeDefined();
      const sql = postgres(test.url as string, { max: 1, onnotice: () => {} });
      try {
        const rows = await sql`select 1 from information_schema.schemata where schema_name = ${schema as string}`;
        expect(rows).toHaveLength(0);
      } finally {
        await sql.end({ timeout: 5 });
      }
    } finally {
      await test.close();
    }
  });
});

describe.runIf(needs('DATABASE_URL') && needs('REDIS_URL'))('palisade demo with REDIS_URL', () => {
  it('takes locks and fences from Redis and tells the same story', { timeout: 180_000 }, async () => {
    const test = await postgresDatabase();
    try {
      const run = await runCli(['demo'], { DATABASE_URL: test.url }, 120_000);
      expect(run.stdout).toMatch(/locks: {4}Redis at REDIS_URL \(127\.0\.0\.1:\d+\/?\): SET NX PX/);
      expectStory(run);
    } finally {
      await test.close();
    }
  });
});

describe('palisade demo / palisade: usage', () => {
  it('refuses a bad --ttl in one line, exit 2', async () => {
    const run = await runCli(['demo', '--ttl', '5']);
    expect(run.code).toBe(2);
    expect(run.stderr).toBe('palisade demo: --ttl must be an integer number of milliseconds in 200 … 10000\n');
    expect(run.stdout).toBe('');
  });

  it('has --help for every command, and names an unknown one', { timeout: 120_000 }, async () => {
    for (const command of ['demo', 'migrate', 'locks', 'fence-trigger']) {
      const run = await runCli([command, '--help']);
      expect(run.code).toBe(0);
      expect(run.stdout).toMatch(new RegExp(`^Usage: palisade ${command}`));
    }
    const top = await runCli(['--help']);
    expect(top.code).toBe(0);
    expect(top.stdout).toMatch(/Commands:\n {2}demo/);
    const unknown = await runCli(['frobnicate']);
    expect(unknown.code).toBe(2);
    expect(unknown.stderr).toMatch(
      /^palisade: unknown command "frobnicate" \(commands: demo, migrate, locks, fence-trigger/,
    );
  });
});
