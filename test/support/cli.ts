/**
 * Runs the `palisade` CLI from its source (`src/cli/main.ts`, see
 * ./programs.ts) as a separate OS process, the way a user or a replica
 * would, and collects its exit code and output.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { programArgs } from './programs.js';

export interface CliRun {
  /** Exit code, `null` when killed by a signal. */
  readonly code: number | null;
  readonly stdout: string;
  readonly stderr: string;
}

export interface StartedCli {
  readonly child: ChildProcess;
  /** Settles when the process exits; rejects if it outlives `timeoutMs` (it is then killed). */
  readonly done: Promise<CliRun>;
}

const live = new Set<ChildProcess>();

/**
 * Starts the CLI with `args`. `env` is merged over this process's
 * environment; a variable set to `undefined` is removed.
 */
export function startCli(
  args: readonly string[],
  env: Record<string, string | undefined> = {},
  timeoutMs = 90_000,
): StartedCli {
  const merged: NodeJS.ProcessEnv = { ...process.env };
  for (const [k, v] of Object.entries(env)) {
    if (v === undefined) delete merged[k];
    else merged[k] = v;
  }
  const child = spawn(process.execPath, [...programArgs('src/cli/main.ts'), ...args], {
    env: merged,
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  live.add(child);
  let stdout = '';
  let stderr = '';
  child.stdout?.on('data', (chunk) => {
    stdout += String(chunk);
  });
  child.stderr?.on('data', (chunk) => {
    stderr += String(chunk);
  });
  const done = new Promise<CliRun>((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGCONT');
      child.kill('SIGKILL');
      reject(
        new Error(
          `palisade ${args.join(' ')}: still running after ${timeoutMs} ms; stdout: ${stdout}; stderr: ${stderr}`,
        ),
      );
    }, timeoutMs);
    child.on('close', (code) => {
      clearTimeout(timer);
      live.delete(child);
      resolve({ code, stdout, stderr });
    });
  });
  return { child, done };
}

/** Runs the CLI to completion. */
export function runCli(
  args: readonly string[],
  env: Record<string, string | undefined> = {},
  timeoutMs?: number,
): Promise<CliRun> {
  return startCli(args, env, timeoutMs).done;
}

/** Kills every CLI process a test left running. */
export async function killAllCli(): Promise<void> {
  const exits = [...live].map((child) => new Promise((resolve) => child.once('close', resolve)));
  for (const child of live) {
    child.kill('SIGCONT');
    child.kill('SIGKILL');
  }
  await Promise.all(exits);
}
