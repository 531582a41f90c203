/**
 * A worker process of the lock backend contract's cross-process check (see
 * contract-process.ts): builds the backend from the contract's process
 * module, then enters a critical section `rounds` times through
 * `createLockManager`. Inside, it claims a marker file with an exclusive
 * create (a second process inside at the same time finds it taken) and
 * appends its fence to a shared log, so the parent sees the order in which
 * sections were entered. Prints one JSON line with what it saw, then exits.
 */
import { appendFileSync, closeSync, openSync, unlinkSync } from 'node:fs';
import { join } from 'node:path';
import { setTimeout as delay } from 'node:timers/promises';
import { pathToFileURL } from 'node:url';
import type { LockBackend } from '../fencing/backend.js';
import { createLockManager, type LockManagerHooks } from '../fencing/lock-manager.js';

/** What the parent passes as the worker's one argument (JSON). */
export interface ContractWorkerArgs {
  readonly module: string;
  readonly options: unknown;
  readonly dir: string;
  readonly lock: string;
  readonly rounds: number;
  readonly ttlMs: number;
}

/** What the worker prints when done. */
export interface ContractWorkerReport {
  readonly entered: number;
  readonly overlaps: number;
  readonly lost: number;
}

interface Opened {
  readonly backend: LockBackend;
  readonly hooks?: LockManagerHooks;
  close(): Promise<void>;
}

async function main(args: ContractWorkerArgs): Promise<ContractWorkerReport> {
  const url = args.module.startsWith('file:') ? args.module : pathToFileURL(args.module).href;
  const { openBackend } = (await import(url)) as { openBackend: (options: unknown) => Promise<Opened> };
  const opened = await openBackend(args.options);
  const manager = createLockManager(opened.backend, opened.hooks);
  const marker = join(args.dir, 'inside');
  const log = join(args.dir, 'fences');
  let entered = 0;
  let overlaps = 0;
  let lost = 0;
  try {
    for (let round = 0; round < args.rounds; round++) {
      const lease = await manager.acquire(args.lock, { ttlMs: args.ttlMs, waitMs: 60_000 });
      let claimed = false;
      try {
        try {
          closeSync(openSync(marker, 'wx'));
          claimed = true;
        } catch {
          overlaps++;
        }
        entered++;
        appendFileSync(log, `${lease.fence}\n`);
        // Stay inside across a turn of the event loop, so another holder would find the marker.
        await delay(2);
      } finally {
        if (claimed) unlinkSync(marker);
        if ((await lease.release()) === 'lost') lost++;
      }
    }
  } finally {
    await manager.close();
    await opened.close();
  }
  return { entered, overlaps, lost };
}

const args = JSON.parse(process.argv[2] ?? '{}') as ContractWorkerArgs;
main(args).then(
  (report) => {
    process.stdout.write(`${JSON.stringify(report)}\n`);
    process.exit(0);
  },
  (err: unknown) => {
    process.stderr.write(`${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
    process.exit(1);
  },
);
