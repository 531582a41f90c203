/**
 * The chaos run's network: each worker reaches Postgres (and, on the redis
 * backend, its Redis) through loopback TCP proxies of its own
 * (test/fixtures/tcp-proxy.ts), kept across that worker's restarts. The
 * `partition` fault freezes a worker's proxies (SIGSTOP): its sockets stay
 * open and nothing is forwarded while its process runs on — its timers
 * fire, its lease runs out locally, its calls time out — and what it sent
 * meanwhile reaches the server late, when the proxies are healed (SIGCONT).
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { closeSync, openSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const PROXY = join(ROOT, 'test', 'fixtures', 'tcp-proxy.ts');
/** A proxy is a tsx process: seconds to start on a busy 2-core machine. */
const START_MS = 60_000;

/** One loopback proxy in front of one server. */
export interface ChaosProxy {
  /** What it forwards to, for the nemesis' log: `Postgres`, `Redis`. */
  readonly name: string;
  /** The loopback port it listens on. */
  readonly port: number;
  /** SIGSTOP: connections stay open, nothing is forwarded. */
  freeze(): void;
  /** SIGCONT: what was buffered meanwhile is delivered. */
  heal(): void;
  /** Ends it (SIGKILL); its connections close. Bounded: 10 s. */
  stop(): Promise<void>;
}

/**
 * Starts a proxy to `target` on 127.0.0.1 that exits by itself after
 * `exitAfterMs` (an end for a run that fails to stop it); its stderr goes to
 * `stderrPath`.
 */
export async function startChaosProxy(
  name: string,
  target: number,
  exitAfterMs: number,
  stderrPath: string,
): Promise<ChaosProxy> {
  const stderr = openSync(stderrPath, 'a');
  let child: ChildProcess;
  try {
    child = spawn(process.execPath, ['--import', 'tsx', PROXY, JSON.stringify({ target, exitAfterMs })], {
      cwd: ROOT,
      stdio: ['ignore', 'pipe', stderr],
    });
  } finally {
    closeSync(stderr);
  }
  const exited = new Promise<void>((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) resolve();
    else child.once('exit', () => resolve());
  });
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill('SIGCONT');
      child.kill('SIGKILL');
    }
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([exited, new Promise((resolve) => (timer = setTimeout(resolve, 10_000)))]);
    clearTimeout(timer);
  };
  let port: number;
  try {
    port = await new Promise<number>((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new Error(`the ${name} proxy did not listen within ${START_MS} ms`)),
        START_MS,
      );
      child.once('exit', (code, signal) => {
        clearTimeout(timer);
        reject(
          new Error(`the ${name} proxy exited before it listened (code ${code}, signal ${signal}); see ${stderrPath}`),
        );
      });
      createInterface({ input: child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
        try {
          const m = JSON.parse(line) as { event?: string; port?: number };
          if (m.event === 'listening' && typeof m.port === 'number') {
            clearTimeout(timer);
            resolve(m.port);
          }
        } catch {
          // not a message of the proxy's
        }
      });
    });
  } catch (err) {
    await stop();
    throw err;
  }
  return {
    name,
    port,
    freeze: () => child.kill('SIGSTOP'),
    heal: () => child.kill('SIGCONT'),
    stop,
  };
}

/** `url` with its host and port replaced by the loopback proxy's. */
export function throughProxy(url: string, proxy: ChaosProxy): string {
  const u = new URL(url);
  u.host = `127.0.0.1:${proxy.port}`;
  return u.toString();
}
