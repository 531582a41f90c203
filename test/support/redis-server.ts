/**
 * A Redis server of a test's own, on a free loopback port, without
 * persistence (like the machine's): the test may FLUSHDB, kill and restart
 * it without touching anyone else's keys.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { freePort } from './ports.js';
import { sleep } from './sleep.js';

export interface PrivateRedis {
  readonly port: number;
  readonly url: string;
  /** Kills the server with SIGKILL (every key is lost) and starts it again on the same port. */
  restart(): Promise<void>;
  /** SIGSTOP: the server keeps its connections but answers nothing until `resume()`. */
  pause(): void;
  resume(): void;
  stop(): Promise<void>;
}

/** Starts `redis-server` on a free loopback port (with `extraArgs`, e.g. `--replicaof`) and waits (bounded) until it answers PING. */
export async function startPrivateRedis(extraArgs: string[] = []): Promise<PrivateRedis> {
  const port = await freePort();
  // A directory of its own: a replica writes the RDB it receives to disk even with `--save ""`.
  const dir = await mkdtemp(join(tmpdir(), 'palisade-redis-'));
  const args = ['--dir', dir, ...extraArgs];
  let child = await launch(port, args);
  return {
    port,
    url: `redis://127.0.0.1:${port}`,
    async restart() {
      await kill(child);
      child = await launch(port, args);
    },
    pause: () => child.kill('SIGSTOP'),
    resume: () => child.kill('SIGCONT'),
    async stop() {
      child.kill('SIGCONT');
      await kill(child);
      await rm(dir, { recursive: true, force: true });
    },
  };
}

async function launch(port: number, extraArgs: string[]): Promise<ChildProcess> {
  const child = spawn(
    'redis-server',
    [
      '--port',
      String(port),
      '--bind',
      '127.0.0.1',
      '--save',
      '',
      '--appendonly',
      'no',
      '--daemonize',
      'no',
      ...extraArgs,
    ],
    { stdio: 'ignore' },
  );
  const probe = new Redis(port, '127.0.0.1', { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
  probe.on('error', () => {});
  try {
    for (let attempt = 0; attempt < 100; attempt++) {
      if (child.exitCode !== null) throw new Error(`redis-server on port ${port} exited with ${child.exitCode}`);
      try {
        await probe.connect();
        if ((await probe.ping()) === 'PONG') return child;
      } catch {
        probe.disconnect();
        await sleep(50);
      }
    }
    throw new Error(`redis-server on port ${port} did not answer within 100 attempts`);
  } finally {
    probe.disconnect();
  }
}

async function kill(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise((resolve) => child.once('exit', resolve));
  child.kill('SIGKILL');
  await exited;
}
