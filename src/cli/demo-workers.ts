/**
 * The demo's side of the worker protocol (`demo-shared.ts`): starts a
 * worker process, sends it one command at a time and waits, bounded, for
 * its answer; pauses and resumes it with real signals.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { CliError } from '../errors.js';
import type { WorkerCommand, WorkerConfig } from './demo-shared.js';

/** The longest one step of the story may take before the demo gives up. */
export const STEP_TIMEOUT_MS = 30_000;

/** A demo worker process, driven one command at a time. */
export class DemoWorker {
  readonly child: ChildProcess;
  readonly ready: Promise<void>;
  readonly #replies = new Map<number, (reply: Record<string, unknown>) => void>();
  #nextId = 1;
  #stderr = '';
  #exited = false;
  readonly exited: Promise<void>;

  constructor(
    readonly label: string,
    config: WorkerConfig,
  ) {
    const { args } = workerEntry();
    this.child = spawn(process.execPath, [...args, JSON.stringify(config)], {
      stdio: ['pipe', 'pipe', 'pipe'],
      env: process.env,
    });
    live.add(this.child);
    this.child.stderr?.on('data', (chunk) => {
      this.#stderr = (this.#stderr + String(chunk)).slice(-2000);
    });
    createInterface({ input: this.child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
      let message: Record<string, unknown>;
      try {
        message = JSON.parse(line) as Record<string, unknown>;
      } catch {
        return;
      }
      const id = Number(message.id);
      this.#replies.get(id)?.(message);
      this.#replies.delete(id);
    });
    this.exited = new Promise((resolve) =>
      this.child.on('exit', () => {
        this.#exited = true;
        live.delete(this.child);
        for (const wake of this.#replies.values()) wake({ ok: false, error: `worker ${label} exited` });
        this.#replies.clear();
        resolve();
      }),
    );
    this.ready = this.#await(0).then(() => undefined);
  }

  get pid(): number {
    return this.child.pid ?? -1;
  }

  #await(id: number): Promise<Record<string, unknown>> {
    return new Promise((resolve, reject) => {
      if (this.#exited) {
        reject(this.#failure('exited'));
        return;
      }
      const timer = setTimeout(() => {
        this.#replies.delete(id);
        reject(this.#failure(`did not answer within ${STEP_TIMEOUT_MS / 1000} s`));
      }, STEP_TIMEOUT_MS);
      this.#replies.set(id, (reply) => {
        clearTimeout(timer);
        if (reply.ok === true) resolve(reply);
        else reject(this.#failure(String(reply.error)));
      });
    });
  }

  #failure(what: string): CliError {
    const detail = this.#stderr.trim().split('\n').at(-1);
    return new CliError(`worker ${this.label} ${what}${detail ? ` (${detail})` : ''}`);
  }

  /** Sends one command and resolves with the worker's answer. */
  call<C extends WorkerCommand['cmd']>(
    cmd: C,
    params: Omit<Extract<WorkerCommand, { cmd: C }>, 'id' | 'cmd'> = {} as never,
  ): Promise<Record<string, unknown>> {
    const id = this.#nextId++;
    const answer = this.#await(id);
    this.child.stdin?.write(`${JSON.stringify({ id, cmd, ...params })}\n`);
    return answer;
  }

  pause(): void {
    this.child.kill('SIGSTOP');
  }

  resume(): void {
    this.child.kill('SIGCONT');
  }

  /** Asks the worker to exit; kills it if it has not within 5 s. */
  async stop(): Promise<void> {
    if (this.#exited) return;
    this.resume();
    this.child.stdin?.write(`${JSON.stringify({ id: this.#nextId++, cmd: 'exit' })}\n`);
    const timer = setTimeout(() => this.child.kill('SIGKILL'), 5000);
    await this.exited;
    clearTimeout(timer);
  }
}

// Workers still running when the demo ends for any reason: never leave one stopped.
const live = new Set<ChildProcess>();
export function killLive(): void {
  for (const child of live) {
    child.kill('SIGCONT');
    child.kill('SIGKILL');
  }
}

/** How to start the worker: its compiled file, or its TypeScript source through tsx. */
function workerEntry(): { args: string[] } {
  const fromSource = import.meta.url.endsWith('.ts');
  const file = fileURLToPath(new URL(fromSource ? './demo-worker.ts' : './demo-worker.js', import.meta.url));
  return { args: fromSource ? ['--import', import.meta.resolve('tsx'), file] : [file] };
}
