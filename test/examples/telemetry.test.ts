/**
 * examples/telemetry — the demo's story exported through the OpenTelemetry
 * SDK's console exporters, run as a user would run it (its own process,
 * embedded PGlite): the refused write is on the console as a span with
 * outcome `stale` and as one count of `palisade.write.refused`; the stalled
 * worker's lease as one `palisade.lock.lost` with reason `ttl_expired`.
 */
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';

const run = promisify(execFile);

/** The objects the console exporters printed (each a block that ends with a `}` line), as text. */
function printedObjects(stdout: string): string[] {
  return stdout
    .split(/^\}$/m)
    .map((block) => block.slice(block.indexOf('{')))
    .filter((block) => block.startsWith('{'));
}

describe('examples/telemetry (its own process, embedded PGlite)', () => {
  it('shows the refused write as a span and a metric, and the lost lease with its reason', async () => {
    const { stdout } = await run(process.execPath, ['--import', 'tsx', 'examples/telemetry/index.ts'], {
      timeout: 120_000,
      maxBuffer: 16 * 1024 * 1024,
    });
    const story = stdout.split('\n').filter((line) => line.startsWith('--- '));
    expect(story).toEqual([
      '--- A  took the lock "counter" with fence 1',
      '--- A  stalled past its TTL: its lease is lost (A does not know yet)',
      '--- B  took the lock with fence 2; its increment: applied',
      '--- A  woke up and wrote with fence 1: STALE — the database refused it',
      "--- result: count = 1; A's late write: stale. Metrics follow.",
    ]);

    const objects = printedObjects(stdout);
    const writes = objects.filter((o) => o.includes("name: 'UPDATE visits'"));
    expect(writes).toHaveLength(2);
    const stale = writes.filter((o) => o.includes("'palisade.write.outcome': 'stale'"));
    expect(stale).toHaveLength(1);
    expect(stale[0]).toContain("'palisade.fence': '1'");
    expect(stale[0]).toContain("'palisade.fence.current': '2'");

    const metric = (name: string) => objects.filter((o) => o.includes(`name: '${name}'`) && o.includes('dataPoints'));
    const refused = metric('palisade.write.refused');
    expect(refused).toHaveLength(1);
    expect(refused[0]).toMatch(/'palisade\.write\.outcome': 'stale'\s*\},[\s\S]*?value: 1\s*\}/);
    expect([...(refused[0] as string).matchAll(/value: (\d+)/g)].map((m) => m[1])).toEqual(['1']);
    const lost = metric('palisade.lock.lost');
    expect(lost).toHaveLength(1);
    expect(lost[0]).toMatch(/'palisade\.lock\.lost\.reason': 'ttl_expired'\s*\},[\s\S]*?value: 1\s*\}/);
    expect(stdout).not.toContain("'counter'"); // the lock's name is no attribute
  });
});
