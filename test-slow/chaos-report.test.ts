/**
 * The chaos report in a real browser: a short chaos run per backend, its
 * report.html opened by headless Chromium (Debian's `chromium`; no browser
 * download), and the DOM the browser built checked against the history —
 * one refused-write mark per stale write, a lane per worker, the verdict at
 * the top — plus a screenshot saved under .chaos/screenshots/.
 */
import { execFile } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { type ChaosBackend, runChaos } from '../scripts/chaos.js';
import { readHistory } from '../src/testing/history.js';
import { needs } from '../test/support/services.js';

const run = promisify(execFile);
const CHROMIUM = ['/usr/bin/chromium', '/usr/bin/chromium-browser'].find((p) => existsSync(p));
const SCREENSHOTS = resolve('.chaos', 'screenshots');

/** Runs headless Chromium once with a fresh profile; returns its stdout. Bounded to 90 s. */
async function chromium(args: string[]): Promise<string> {
  const profile = mkdtempSync(join(tmpdir(), 'palisade-chromium-'));
  try {
    const { stdout } = await run(
      CHROMIUM as string,
      [
        '--headless',
        '--no-sandbox', // tests run as root in CI
        '--disable-gpu',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
        '--hide-scrollbars',
        `--user-data-dir=${profile}`,
        ...args,
      ],
      { timeout: 90_000, maxBuffer: 64 * 1024 * 1024 },
    );
    return stdout;
  } finally {
    rmSync(profile, { recursive: true, force: true });
  }
}

const count = (html: string, re: RegExp) => [...html.matchAll(re)].length;

const backends: ChaosBackend[] = ['postgres', ...(needs('REDIS_SERVER') ? (['redis'] as const) : [])];

describe.runIf(needs('DATABASE_URL') && CHROMIUM !== undefined)('the chaos report in headless Chromium', () => {
  for (const backend of backends) {
    it(`${backend}: every stale write is a refused mark, every worker a lane, the verdict on top`, async () => {
      const result = await runChaos({
        backend,
        workers: 3,
        seconds: 8,
        databaseUrl: process.env.DATABASE_URL as string,
      });
      const page = join(result.outDir, 'report.html');
      expect(existsSync(page)).toBe(true);
      const history = readHistory(join(result.outDir, 'history.jsonl'));
      const stale = history.filter((e) => e.op === 'increment' && e.type === 'fail' && e.reason === 'stale').length;
      const workers = [...new Set(history.map((e) => e.process))].filter((p) => p !== 'nemesis' && p !== 'probe');
      expect(workers.length).toBe(3);

      const dom = await chromium(['--dump-dom', `file://${page}`]);
      // What the browser parsed and drew, not the file as written: the inline script's counts are in the DOM.
      expect(count(dom, /<g class="write write-refused"/g)).toBe(stale);
      expect(dom).toContain(`data-drawn-refused="${stale}"`);
      expect(dom).toContain(`data-drawn-lanes="${workers.length}"`);
      for (const w of workers) expect(dom).toContain(`<g class="lane" data-process="${w}">`);
      const verdict = /<div id="verdict" class="(ok|bad)"[^>]*>([^<]*)<\/div>/.exec(dom);
      // The page judges the history (anomalies); a short run in which no stale write happened to be
      // attempted is still a correct page, though the run itself proved nothing (result.ok false).
      expect(verdict?.[1]).toBe(result.report.anomalies.length === 0 ? 'ok' : 'bad');
      expect(verdict?.[2]).toMatch(
        result.report.anomalies.length === 0
          ? new RegExp(`^No anomalies found — ${result.report.staleWrites.rejected} stale writes? refused`)
          : /anomalies found$/,
      );
      expect(result.report.staleWrites.rejected).toBe(stale);
      expect(count(dom, /<g class="lease /g)).toBeGreaterThan(0);

      mkdirSync(SCREENSHOTS, { recursive: true });
      const shot = join(SCREENSHOTS, `chaos-report-${backend}.png`);
      rmSync(shot, { force: true });
      await chromium(['--window-size=1500,560', `--screenshot=${shot}`, `file://${page}`]);
      const png = readFileSync(shot);
      expect(png.subarray(1, 4).toString('latin1')).toBe('PNG');
      expect(png.length).toBeGreaterThan(10_000);

      if (result.ok) rmSync(result.outDir, { recursive: true, force: true });
    });
  }
});
