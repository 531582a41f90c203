/**
 * The lock backend contract's cross-process check: several OS processes
 * (contract-worker) contend for one lock through the same backend; their
 * critical sections must never overlap and must be entered in fence order.
 */
import { spawn } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, extname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { ContractExpect, ContractSubject, LockBackendContract } from './contract.js';
import type { ContractWorkerArgs, ContractWorkerReport } from './contract-worker.js';

const PROCESSES = 3;
const ROUNDS = 20;
/** The most one worker may run before it is killed and the check fails. */
const WORKER_LIMIT_MS = 90_000;

/** The worker script beside this module (`.ts` when run from source, `.js` once built). */
function workerScript(): string {
  const here = fileURLToPath(import.meta.url);
  return join(dirname(here), `contract-worker${extname(here)}`);
}

/** Runs one worker; resolves with its report, or rejects with its stderr when it fails or outlives the limit. */
function runWorker(args: ContractWorkerArgs, execArgv: readonly string[]): Promise<ContractWorkerReport> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [...execArgv, workerScript(), JSON.stringify(args)], {
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (chunk) => {
      stdout += String(chunk);
    });
    child.stderr.on('data', (chunk) => {
      stderr = (stderr + String(chunk)).slice(-4000);
    });
    const limit = setTimeout(() => child.kill('SIGKILL'), WORKER_LIMIT_MS);
    child.on('error', reject);
    child.on('exit', (code, signal) => {
      clearTimeout(limit);
      const line = stdout.trim().split('\n').pop() ?? '';
      if (code === 0) {
        try {
          return resolve(JSON.parse(line) as ContractWorkerReport);
        } catch {
          // fall through: a worker that printed no report failed
        }
      }
      reject(new Error(`contract worker exited with ${signal ?? code}: ${stderr || stdout}`));
    });
  });
}

/**
 * Three processes, twenty rounds each, on one lock: no process found
 * another inside, no lease was lost, every round was entered, and the
 * fences in the order sections were entered strictly increase.
 */
export async function checkNoOverlapAcrossProcesses(
  subject: ContractSubject,
  expect: ContractExpect,
  contract: LockBackendContract,
  ttlMs: number,
): Promise<void> {
  const dir = await mkdtemp(join(tmpdir(), 'palisade-contract-'));
  try {
    const args: ContractWorkerArgs = {
      module: contract.processModule,
      options: subject.processOptions,
      dir,
      lock: 'shared',
      rounds: ROUNDS,
      ttlMs,
    };
    const execArgv = contract.execArgv ?? ['--import', 'tsx'];
    const reports = await Promise.all(Array.from({ length: PROCESSES }, () => runWorker(args, execArgv)));
    const total = reports.reduce(
      (sum, r) => ({ entered: sum.entered + r.entered, overlaps: sum.overlaps + r.overlaps, lost: sum.lost + r.lost }),
      { entered: 0, overlaps: 0, lost: 0 },
    );
    expect(total).toEqual({ entered: PROCESSES * ROUNDS, overlaps: 0, lost: 0 });
    const fences = (await readFile(join(dir, 'fences'), 'utf8')).trim().split('\n').map(BigInt);
    const backwards = fences.flatMap((fence, i) => (i > 0 && fence <= (fences[i - 1] as bigint) ? [i] : []));
    expect({ entries: fences.length, backwards }).toEqual({ entries: PROCESSES * ROUNDS, backwards: [] });
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}
