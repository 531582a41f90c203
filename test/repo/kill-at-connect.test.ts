/**
 * What postgres.js 3.4.9 does when the server ends a connection while the
 * connection's first statement is in flight (README, "When the connection
 * closes inside a transaction" — the driver faults it names), in a process
 * of its own: with the default `fetch_types` the first statement is the
 * driver's own array-type query, and its failure escapes as an unhandled
 * rejection, which ends a Node process; with `fetch_types: false` nothing
 * escapes. Either way the killed backend's error is replayed onto the first
 * query after the reconnect, and a retry goes through. Pins the driver's
 * behaviour behind the README's advice: when an upgrade changes it, this
 * fails and the advice is revisited.
 */
import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { needs } from '../support/services.js';

const run = promisify(execFile);
const FIXTURE = fileURLToPath(new URL('../fixtures/kill-at-connect.mjs', import.meta.url));

interface Outcome {
  transaction: string;
  unhandled: string[];
  after: string[];
}

async function killAtConnect(fetchTypes: 'on' | 'off'): Promise<Outcome> {
  const { stdout } = await run(process.execPath, [FIXTURE, process.env.DATABASE_URL ?? '', fetchTypes], {
    timeout: 30_000,
  });
  return JSON.parse(stdout.trim().split('\n').at(-1) ?? '{}') as Outcome;
}

describe.runIf(needs('DATABASE_URL'))('postgres.js: a connection killed while its first statement is in flight', () => {
  it('with fetch_types: false the transaction call rejects and nothing escapes; the next query gets the old error once', async () => {
    const outcome = await killAtConnect('off');
    expect(outcome.transaction).toMatch(/^rejected /);
    expect(outcome.unhandled).toEqual([]);
    expect(outcome.after).toEqual(['rejected 57P01', 'ok']);
  });

  it('with the default fetch_types the array-type fetch is what was killed, and its rejection escapes unhandled', async () => {
    const outcome = await killAtConnect('on');
    expect(outcome.transaction).toMatch(/^rejected /);
    expect(outcome.unhandled).toEqual(['57P01']);
    expect(outcome.after).toEqual(['ok', 'ok']);
  });
});
