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
import { connect, createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Etcd3 } from 'etcd3';
import { freePorts, listenOnLoopback } from './ports.js';
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
  /**
   * Cuts `member` off from its peers (it stays up, and reachable by clients): every peer connection to or
   * from it is dropped and new ones refused, until {@link rejoin}. Only for a cluster started with
   * `{ partitionable: true }` (peer traffic then goes through a proxy of the test's own).
   */
  isolate(member: EtcdMember): Promise<void>;
  /** Ends {@link isolate}. */
  rejoin(): void;
  stop(): Promise<void>;
}

/** Options of {@link startEtcdCluster}. */
export interface EtcdClusterOptions {
  /** Peer traffic through a proxy, so that {@link EtcdCluster.isolate} can cut a member off. */
  readonly partitionable?: boolean;
}

interface Status {
  readonly memberId: string;
  readonly leader: string;
}

/** Starts a cluster and waits until it has a leader (bounded: `timeoutMs`). */
export async function startEtcdCluster(
  size = 3,
  timeoutMs = 30_000,
  options: EtcdClusterOptions = {},
): Promise<EtcdCluster> {
  const binary = binaries.ETCD.path;
  if (!binary) throw new Error('etcd is not on PATH (Debian package etcd-server)');
  const dir = await mkdtemp(join(tmpdir(), 'palisade-etcd-'));
  const ports = await freePorts(size * 3);
  const newToken = () => `palisade-${randomBytes(4).toString('hex')}`;
  let token = newToken();
  const specs = Array.from({ length: size }, (_, i) => ({
    name: `m${i}`,
    clientUrl: `http://127.0.0.1:${ports[3 * i]}`,
    peerUrl: `http://127.0.0.1:${ports[3 * i + 1]}`,
    /** What the others dial: the proxy's port when partitionable. */
    advertisedPeerUrl: `http://127.0.0.1:${ports[3 * i + (options.partitionable ? 2 : 1)]}`,
    dataDir: join(dir, `m${i}`),
  }));
  const peers = options.partitionable
    ? await peerProxy(specs.map((s) => [Number(new URL(s.advertisedPeerUrl).port), Number(new URL(s.peerUrl).port)]))
    : undefined;
  const initialCluster = specs.map((s) => `${s.name}=${s.advertisedPeerUrl}`).join(',');
  const admins = new Map<string, Etcd3>();
  /** Member ids by name, as last seen: a frozen member cannot tell its own. */
  const ids = new Map<string, string>();
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
            `--initial-advertise-peer-urls=${spec.advertisedPeerUrl}`,
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
    for (const [i, s] of statuses.entries()) if (s) ids.set(running[i]?.name ?? '', s.memberId);
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
    async isolate(member) {
      if (!peers) throw new Error('isolate() needs a cluster started with { partitionable: true }');
      const index = members.indexOf(member);
      const id = ids.get(member.name) ?? (await cluster.memberId(member));
      peers.cut(index, BigInt(id).toString(16));
    },
    rejoin() {
      peers?.cut(-1, undefined);
    },
    async stop() {
      for (const client of admins.values()) client.close();
      await Promise.all(members.map((m) => m.kill()));
      await peers?.close();
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

interface PeerProxy {
  /** Drops and refuses peer connections to member `index` and from the member of hex id `id`; -1 ends it. */
  cut(index: number, id: string | undefined): void;
  close(): Promise<void>;
}

/**
 * Forwards each `[listen, target]` port pair of peer traffic. etcd's peer requests name their sender in
 * an `X-Server-From` header (the member id in hex): read before forwarding, so connections from the cut
 * member are known as well as those to it.
 */
async function peerProxy(pairs: number[][]): Promise<PeerProxy> {
  let cutIndex = -1;
  let cutId: string | undefined;
  const open = new Set<{ index: number; from: string | undefined; sockets: Socket[] }>();
  const crosses = (index: number, from: string | undefined) =>
    cutIndex >= 0 && (index === cutIndex || (from !== undefined && from === cutId));
  const servers: Server[] = [];
  for (const [index, [listen, target]] of pairs.entries()) {
    const server = createServer((c) => {
      let head = Buffer.alloc(0);
      c.on('error', () => c.destroy());
      const onData = (d: Buffer) => {
        head = Buffer.concat([head, d]);
        if (head.indexOf('\r\n\r\n') < 0 && head.length < 16_384) return;
        c.off('data', onData);
        const from = /x-server-from:\s*([0-9a-f]+)/i.exec(head.toString('latin1'))?.[1];
        if (crosses(index, from)) {
          c.destroy();
          return;
        }
        const u = connect(target as number, '127.0.0.1');
        const conn = { index, from, sockets: [c, u] };
        open.add(conn);
        const end = () => {
          c.destroy();
          u.destroy();
          open.delete(conn);
        };
        u.on('error', end);
        c.on('close', end);
        u.on('close', end);
        u.write(head);
        c.pipe(u);
        u.pipe(c);
      };
      c.on('data', onData);
    });
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(listen, '127.0.0.1', () => resolve());
    });
    servers.push(server);
  }
  return {
    cut(index, id) {
      cutIndex = index;
      cutId = id;
      for (const conn of [...open]) {
        if (crosses(conn.index, conn.from)) for (const s of conn.sockets) s.destroy();
      }
    },
    async close() {
      for (const conn of open) for (const s of conn.sockets) s.destroy();
      await Promise.all(servers.map((s) => new Promise((resolve) => s.close(resolve))));
    },
  };
}

/** A TCP proxy in front of some loopback URLs: {@link TcpProxy.reset} drops every open connection. */
export interface TcpProxy {
  /** One `http://127.0.0.1:port` per target, in order. */
  readonly urls: string[];
  /** Drops every open connection, as a load balancer's idle timeout or a network blip does. */
  reset(): void;
  /** Cuts the next connection the proxy accepts `ms` after it accepted it (a second blip, as it reconnects). */
  cutNext(ms: number): void;
  close(): Promise<void>;
}

/** Starts a {@link TcpProxy} for `targets` (`http://127.0.0.1:port` URLs). */
export async function startTcpProxy(targets: readonly string[]): Promise<TcpProxy> {
  const live = new Set<Socket>();
  const servers: Server[] = [];
  const urls: string[] = [];
  let cut: number | undefined;
  for (const target of targets) {
    const port = Number(new URL(target).port);
    const server = createServer((c) => {
      const u = connect(port, '127.0.0.1');
      live.add(c);
      live.add(u);
      const end = () => {
        c.destroy();
        u.destroy();
        live.delete(c);
        live.delete(u);
      };
      for (const s of [c, u]) {
        s.on('error', end);
        s.on('close', end);
      }
      c.pipe(u);
      u.pipe(c);
      if (cut !== undefined) setTimeout(end, cut).unref();
      cut = undefined;
    });
    urls.push(`http://127.0.0.1:${await listenOnLoopback(server)}`);
    servers.push(server);
  }
  return {
    urls,
    reset() {
      for (const s of [...live]) s.destroy();
      live.clear();
    },
    cutNext(ms) {
      cut = ms;
    },
    async close() {
      for (const s of [...live]) s.destroy();
      await Promise.all(servers.map((s) => new Promise((resolve) => s.close(resolve))));
    },
  };
}
