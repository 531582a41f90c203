/**
 * Renders `report.html` from a chaos run's saved history, so any run — the
 * long one included — can be re-rendered without running it again:
 *
 * ```sh
 * npm run chaos:report -- <run directory>   # the --out of npm run chaos
 * ```
 */
import { pathToFileURL } from 'node:url';
import { renderChaosReport } from './render.js';

if (process.argv[1] && pathToFileURL(process.argv[1]).href === import.meta.url) {
  const dirs = process.argv.slice(2);
  if (dirs.length === 0) {
    console.error('usage: npm run chaos:report -- <run directory> [more directories]');
    process.exitCode = 2;
  } else {
    for (const dir of dirs) console.log(renderChaosReport(dir));
  }
}
