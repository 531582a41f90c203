/**
 * Renders `report.html` from a chaos run's saved history, so any run — the
 * long one included — can be re-rendered without running it again, and
 * optionally photographs it with headless Chromium (Debian's `chromium`):
 *
 * ```sh
 * npm run chaos:report -- <run directory>                       # the --out of npm run chaos
 * npm run chaos:report -- <run directory> --screenshot docs/chaos-report-timeline.png
 * ```
 */
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { renderChaosReport } from './render.js';

/**
 * Saves a PNG of a rendered report, wide enough for the whole timeline.
 * Needs a Chromium binary (`CHROMIUM`, else /usr/bin/chromium); no network.
 */
export function screenshotReport(page: string, png: string): void {
  const browser = process.env.CHROMIUM ?? ['/usr/bin/chromium', '/usr/bin/chromium-browser'].find((p) => existsSync(p));
  if (!browser) throw new Error('no chromium found: apt-get install chromium, or set CHROMIUM');
  const html = readFileSync(page, 'utf8');
  const svg = /<svg id="timeline"[^>]* width="(\d+)" height="(\d+)"/.exec(html);
  const width = Math.max(1200, Number(svg?.[1] ?? 1200) + 60);
  const height = Number(svg?.[2] ?? 300) + 300;
  const profile = mkdtempSync(join(tmpdir(), 'palisade-chromium-'));
  try {
    execFileSync(
      browser,
      [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
        '--hide-scrollbars',
        `--user-data-dir=${profile}`,
        `--window-size=${width},${height}`,
        `--screenshot=${resolve(png)}`,
        pathToFileURL(resolve(page)).href,
      ],
      { stdio: 'ignore', timeout: 120_000 },
    );
  } finally {
    rmSync(profile, { recursive: true, force: true });
  }
}

if (process.argv[1] && pathToFileURL(process.argv[1]).href === import.meta.url) {
  const { values, positionals } = parseArgs({ allowPositionals: true, options: { screenshot: { type: 'string' } } });
  if (positionals.length !== 1) {
    console.error('usage: npm run chaos:report -- <run directory> [--screenshot out.png]');
    process.exitCode = 2;
  } else {
    const page = renderChaosReport(positionals[0] as string);
    console.log(page);
    if (values.screenshot) {
      screenshotReport(page, values.screenshot);
      console.log(values.screenshot);
    }
  }
}
