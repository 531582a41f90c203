/**
 * Separate OS processes for the multi-process scenarios: a worker is a TypeScript
 * script (run as ./programs.ts says), speaking JSON lines on stdout and
 * reading commands line by line on stdin. The parent pauses it with SIGSTOP,
 * resumes it with SIGCONT, or kills it with SIGKILL — real faults.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { createInterface } from 'node:readline';
import { programArgs } from './programs.js';

/** One JSON message a worker printed. */
export type Message = Record<string, unknown> & { event: string };

export interface Worker {
  readonly pid: number;
  /** Every message so far, in order. */
  readonly messages: Message[];
  /** Resolves with the first message (past or future) matching `match`; rejects after `timeoutMs` or if the worker exits first. */
  next(match: (m: Message) => boolean, timeoutMs?: number): Promise<Message>;
  /** Sends one command line to the worker's stdin. */
  send(command: Record<string, unknown>): void;
  pause(): void;
  resume(): void;
  kill(): void;
  /** Resolves with the exit code (null when killed by a signal). */
  readonly exited: Promise<number | null>;
}

const live = new Set<ChildProcess>();

/** Starts `script` (a path relative to the repository root) with `args`. */
export function startWorker(
  script: string,
  args: Record<string, unknown>,
  env: Record<string, string | undefined> = {},
): Worker {
  const child = spawn(process.execPath, [...programArgs(script), JSON.stringify(args)], {
    env: { ...process.env, ...env },
    stdio: ['pipe', 'pipe', 'pipe'],
  });
  live.add(child);
  const messages: Message[] = [];
  const waiters = new Set<() => void>();
  let stderr = '';
  child.stderr?.on('data', (chunk) => {
    stderr = (stderr + String(chunk)).slice(-4000);
  });
  createInterface({ input: child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
    try {
      messages.push(JSON.parse(line) as Message);
    } catch {
      messages.push({ event: 'stdout', line });
    }
    for (const wake of waiters) wake();
  });
  const exited = new Promise<number | null>((resolve) =>
    child.on('exit', (code) => {
      live.delete(child);
      for (const wake of waiters) wake();
      resolve(code);
    }),
  );
  let done = false;
  exited.then(() => {
    done = true;
  });

  return {
    pid: child.pid ?? -1,
    messages,
    exited,
    next(match, timeoutMs = 30_000) {
      return new Promise((resolve, reject) => {
        const check = () => {
          const found = messages.find(match);
          if (found) return finish(() => resolve(found));
          if (done)
            return finish(() =>
              reject(new Error(`worker ${child.pid} exited before the expected message; stderr: ${stderr}`)),
            );
        };
        const timer = setTimeout(
          () =>
            finish(() =>
              reject(
                new Error(
                  `worker ${child.pid}: no expected message within ${timeoutMs} ms; got ${JSON.stringify(messages)}; stderr: ${stderr}`,
                ),
              ),
            ),
          timeoutMs,
        );
        const finish = (fn: () => void) => {
          clearTimeout(timer);
          waiters.delete(check);
          fn();
        };
        waiters.add(check);
        check();
      });
    },
    send(command) {
      child.stdin?.write(`${JSON.stringify(command)}\n`);
    },
    pause: () => child.kill('SIGSTOP'),
    resume: () => child.kill('SIGCONT'),
    kill: () => child.kill('SIGKILL'),
  };
}

/** Kills every worker still running (call in afterEach/afterAll). */
export async function killAllWorkers(): Promise<void> {
  const exits = [...live].map((child) => new Promise((resolve) => child.once('exit', resolve)));
  for (const child of live) {
    child.kill('SIGCONT');
    child.kill('SIGKILL');
  }
  await Promise.all(exits);
}
