/**
 * A real etcd cluster of the test's own: `size` members of Debian's `etcd`
 * binary on free loopback ports, each with its own data directory under a
 * temporary directory. Members can be killed (SIGKILL) and started again on
 * the same data, or the whole cluster replaced by a new one on the same
 * URLs. `stop()` kills them all and removes the directory.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Etcd3 } from 'etcd3';
import { freePorts } from './ports.js';
import { binaries } from './services.js';
import { sleep } from './sleep.js';

export interface EtcdMember {
  readonly name: string;
  /** `http://127.0.0.1:port` — what clients connect to. */
  readonly clientUrl: string;
  readonly running: boolean;
  /** Kills the process (SIGKILL) and waits for it to exit. */
  kill(): Promise<void>;
  /** Starts the member again on its data directory (no-op if running). */
  start(): void;
  /** SIGSTOP: a member that keeps its sockets open and answers nobody (a frozen host); no-op if not running. */
  freeze(): void;
  /** SIGCONT after {@link freeze}. */
  thaw(): void;
}

export interface EtcdCluster {
  readonly members: readonly EtcdMember[];
  /** Every member's client URL. */
  readonly endpoints: string[];
  /** The member id (decimal string, as etcd3 reports it) of a running member. */
  memberId(member: EtcdMember): Promise<string>;
  /** The current leader: waits (bounded) until the running members agree on one. */
  leader(timeoutMs?: number): Promise<EtcdMember>;
  /** Waits (bounded) until every running member answers and all agree on a running leader. */
  waitHealthy(timeoutMs?: number): Promise<void>;
  /** Starts every stopped member and waits until the cluster is healthy. */
  heal(timeoutMs?: number): Promise<void>;
  /**
   * Replaces the cluster, as a restore from a snapshot into a new cluster does: every member killed,
   * its data removed, and a new cluster (a new cluster id, revisions from 1) started on the same URLs.
   */
  replace(timeoutMs?: number): Promise<void>;
  /**
   * Wipes the cluster, as an operator who lost its data and started it again with the same flags does:
   * every member killed, its data removed, and started on the same URLs with the same cluster token —
   * the same cluster id (etcd derives it from those), revisions from 1.
   */
  wipe(timeoutMs?: number): Promise<void>;
  stop(): Promise<void>;
}

interface Status {
  readonly memberId: string;
  readonly leader: string;
}

/** Starts a cluster and waits until it has a leader (bounded: `timeoutMs`). */
export async function startEtcdCluster(size = 3, timeoutMs = 30_000): Promise<EtcdCluster> {
  const binary = binaries.ETCD.path;
  if (!binary) throw new Error('etcd is not on PATH (Debian package etcd-server)');
  const dir = await mkdtemp(join(tmpdir(), 'palisade-etcd-'));
  const ports = await freePorts(size * 2);
  const newToken = () => `palisade-${randomBytes(4).toString('hex')}`;
  let token = newToken();
  const specs = Array.from({ length: size }, (_, i) => ({
    name: `m${i}`,
    clientUrl: `http://127.0.0.1:${ports[2 * i]}`,
    peerUrl: `http://127.0.0.1:${ports[2 * i + 1]}`,
    dataDir: join(dir, `m${i}`),
  }));
  const initialCluster = specs.map((s) => `${s.name}=${s.peerUrl}`).join(',');
  const admins = new Map<string, Etcd3>();
  const stderr = new Map<string, string>();

  const members = specs.map((spec) => {
    let child: ChildProcess | undefined;
    const member: EtcdMember = {
      name: spec.name,
      clientUrl: spec.clientUrl,
      get running() {
        return child !== undefined;
      },
      async kill() {
        const c = child;
        if (!c) return;
        const exited = new Promise((resolve) => c.once('exit', resolve));
        c.kill('SIGKILL');
        await exited;
      },
      freeze() {
        child?.kill('SIGSTOP');
      },
      thaw() {
        child?.kill('SIGCONT');
      },
      start() {
        if (child) return;
        const c = spawn(
          binary,
          [
            `--name=${spec.name}`,
            `--data-dir=${spec.dataDir}`,
            `--listen-client-urls=${spec.clientUrl}`,
            `--advertise-client-urls=${spec.clientUrl}`,
            `--listen-peer-urls=${spec.peerUrl}`,
            `--initial-advertise-peer-urls=${spec.peerUrl}`,
            `--initial-cluster=${initialCluster}`,
            '--initial-cluster-state=new',
            `--initial-cluster-token=${token}`,
            '--heartbeat-interval=100',
            '--election-timeout=1000',
            '--logger=zap',
            '--log-outputs=stderr',
            '--log-level=warn',
          ],
          { stdio: ['ignore', 'ignore', 'pipe'], env: withoutEtcdVariables() },
        );
        c.stderr?.on('data', (chunk) => stderr.set(spec.name, ((stderr.get(spec.name) ?? '') + chunk).slice(-4000)));
        c.once('exit', () => {
          if (child === c) child = undefined;
        });
        child = c;
      },
    };
    return member;
  });

  function admin(member: EtcdMember): Etcd3 {
    let client = admins.get(member.name);
    if (!client) {
      client = new Etcd3({ hosts: member.clientUrl, dialTimeout: 1_000 });
      admins.set(member.name, client);
    }
    return client;
  }

  async function status(member: EtcdMember): Promise<Status> {
    const res = await admin(member).maintenance.status({ deadline: Date.now() + 1_000 });
    return { memberId: res.header.member_id, leader: res.leader };
  }

  async function agreedLeader(): Promise<EtcdMember | undefined> {
    const running = members.filter((m) => m.running);
    const statuses = await Promise.all(running.map((m) => status(m).catch(() => undefined)));
    if (statuses.some((s) => !s || s.leader === '0')) return undefined;
    const leaders = new Set(statuses.map((s) => s?.leader));
    if (leaders.size !== 1) return undefined;
    const index = statuses.findIndex((s) => s?.memberId === s?.leader);
    if (index < 0) return undefined;
    // A linearizable read on every running member proves the quorum serves requests.
    const reads = await Promise.all(
      running.map((m) =>
        admin(m)
          .get('palisade-health')
          .options({ deadline: Date.now() + 1_000 })
          .then(() => true)
          .catch(() => false),
      ),
    );
    return reads.every(Boolean) ? running[index] : undefined;
  }

  async function leader(timeout = timeoutMs): Promise<EtcdMember> {
    const until = Date.now() + timeout;
    for (let i = 0; i < 1_000 && Date.now() < until; i++) {
      const found = await agreedLeader();
      if (found) return found;
      await sleep(100);
    }
    const logs = [...stderr.entries()].map(([name, text]) => `${name}: ${text}`).join('\n');
    throw new Error(`etcd cluster has no agreed leader after ${timeout} ms\n${logs}`);
  }

  const cluster: EtcdCluster = {
    members,
    endpoints: members.map((m) => m.clientUrl),
    async memberId(member) {
      return (await status(member)).memberId;
    },
    leader,
    async waitHealthy(timeout = timeoutMs) {
      await leader(timeout);
    },
    async heal(timeout = timeoutMs) {
      for (const m of members) m.start();
      await leader(timeout);
    },
    async replace(timeout = timeoutMs) {
      token = newToken();
      await cluster.wipe(timeout);
    },
    async wipe(timeout = timeoutMs) {
      await Promise.all(members.map((m) => m.kill()));
      await Promise.all(specs.map((spec) => rm(spec.dataDir, { recursive: true, force: true })));
      for (const m of members) m.start();
      await leader(timeout);
    },
    async stop() {
      for (const client of admins.values()) client.close();
      await Promise.all(members.map((m) => m.kill()));
      await rm(dir, { recursive: true, force: true });
    },
  };

  for (const m of members) m.start();
  try {
    await leader(timeoutMs);
  } catch (err) {
    await cluster.stop();
    throw err;
  }
  return cluster;
}

/** etcd reads ETCD_* variables as flags: keep the parent's out of our members. */
function withoutEtcdVariables(): NodeJS.ProcessEnv {
  return Object.fromEntries(Object.entries(process.env).filter(([key]) => !key.startsWith('ETCD_')));
}
