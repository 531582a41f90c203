/**
 * A real Redis Cluster of the test's own: 3 masters + 3 replicas of
 * `redis-server` in cluster mode on free loopback ports (each node with its
 * own port, cluster bus port and directory under a temporary directory, no
 * persistence), joined by `redis-cli --cluster create … --cluster-replicas 1
 * --cluster-yes`. Nodes can be killed, paused (SIGSTOP) and started again.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { freePorts } from './ports.js';
import { binaries } from './services.js';
import { sleep } from './sleep.js';

export interface ClusterNode {
  readonly port: number;
  readonly address: string;
  readonly running: boolean;
  /** SIGKILL, wait for the exit. Every key it held is gone (no persistence). */
  kill(): Promise<void>;
  /** Starts the node again on its port and cluster config (it rejoins; as a replica if it was failed over). */
  start(): Promise<void>;
  pause(): void;
  resume(): void;
  /** A plain (non-cluster) connection to this node, for admin commands. */
  admin(): Redis;
}

/** One line of `CLUSTER NODES`, as seen from some node. */
export interface NodeView {
  readonly id: string;
  readonly address: string;
  readonly port: number;
  readonly flags: readonly string[];
  /** For a replica: the id of its master. */
  readonly masterId: string | null;
  /** Slot ranges served (masters only). */
  readonly slots: readonly [number, number][];
}

export interface RedisClusterHandle {
  readonly nodes: readonly ClusterNode[];
  /** Startup nodes for an ioredis `Cluster`. */
  readonly startupNodes: { host: string; port: number }[];
  /** `CLUSTER NODES` as seen by a running node (skipping nodes that do not answer). */
  view(): Promise<NodeView[]>;
  /** The node that serves `slot` as master, by the cluster's view. */
  masterOf(slot: number): Promise<ClusterNode>;
  /** The replica of the master with id `masterId`. */
  replicaOf(masterId: string): Promise<ClusterNode>;
  nodeId(node: ClusterNode): Promise<string>;
  keyslot(key: string): Promise<number>;
  /** Waits (bounded) until every running node says `cluster_state:ok` and agrees on who serves every slot. */
  waitStable(timeoutMs?: number): Promise<void>;
  /** Starts every stopped node, resumes paused ones, and waits until the cluster is stable with all nodes, each master with a replica. */
  heal(timeoutMs?: number): Promise<void>;
  stop(): Promise<void>;
}

const NODE_TIMEOUT_MS = 1_000;

export async function startRedisCluster(timeoutMs = 30_000): Promise<RedisClusterHandle> {
  const binary = binaries.REDIS_SERVER.path;
  if (!binary) throw new Error('redis-server is not on PATH');
  const dir = await mkdtemp(join(tmpdir(), 'palisade-redis-cluster-'));
  const ports = await freePorts(12);
  const admins = new Map<number, Redis>();
  const paused = new Set<number>();

  const nodes: ClusterNode[] = Array.from({ length: 6 }, (_, i) => {
    const port = ports[2 * i] as number;
    const busPort = ports[2 * i + 1] as number;
    const nodeDir = join(dir, `n${i}`);
    let child: ChildProcess | undefined;
    const node: ClusterNode = {
      port,
      address: `127.0.0.1:${port}`,
      get running() {
        return child !== undefined;
      },
      async kill() {
        const c = child;
        if (!c) return;
        const exited = new Promise((resolve) => c.once('exit', resolve));
        c.kill('SIGCONT');
        c.kill('SIGKILL');
        paused.delete(port);
        await exited;
      },
      async start() {
        if (child) return;
        await mkdir(nodeDir, { recursive: true });
        const c = spawn(
          binary,
          [
            '--port',
            String(port),
            '--cluster-port',
            String(busPort),
            '--bind',
            '127.0.0.1',
            '--cluster-enabled',
            'yes',
            '--cluster-config-file',
            join(nodeDir, 'nodes.conf'),
            '--cluster-node-timeout',
            String(NODE_TIMEOUT_MS),
            // A replica that was cut off (paused) may still be promoted: the test decides.
            '--cluster-replica-validity-factor',
            '0',
            '--cluster-require-full-coverage',
            'no',
            '--save',
            '',
            '--appendonly',
            'no',
            '--dir',
            nodeDir,
            '--daemonize',
            'no',
            '--loglevel',
            'warning',
          ],
          { stdio: 'ignore' },
        );
        c.once('exit', () => {
          if (child === c) child = undefined;
        });
        child = c;
        await waitFor(`redis node ${port} to answer`, 10_000, async () => (await node.admin().ping()) === 'PONG');
      },
      pause() {
        child?.kill('SIGSTOP');
        paused.add(port);
      },
      resume() {
        child?.kill('SIGCONT');
        paused.delete(port);
      },
      admin() {
        let client = admins.get(port);
        if (!client) {
          client = new Redis(port, '127.0.0.1', {
            commandTimeout: 1_000,
            maxRetriesPerRequest: 0,
            enableOfflineQueue: false,
            retryStrategy: () => 100,
          });
          client.on('error', () => {});
          admins.set(port, client);
        }
        return client;
      },
    };
    return node;
  });

  async function view(): Promise<NodeView[]> {
    for (const node of nodes) {
      if (!node.running || paused.has(node.port)) continue;
      try {
        return parseNodes(String(await node.admin().cluster('NODES')));
      } catch {
        // try the next node
      }
    }
    throw new Error('no cluster node answers CLUSTER NODES');
  }

  const byPort = (port: number) => {
    const node = nodes.find((n) => n.port === port);
    if (!node) throw new Error(`no node on port ${port}`);
    return node;
  };

  async function stableOnce(): Promise<boolean> {
    const live = nodes.filter((n) => n.running && !paused.has(n.port));
    const views: string[] = [];
    for (const node of live) {
      const info = String(await node.admin().cluster('INFO'));
      if (!info.includes('cluster_state:ok')) return false;
      const v = parseNodes(String(await node.admin().cluster('NODES')));
      // No live node is seen as failing; every live node sees the same slot map.
      const failing = (n: NodeView) =>
        n.flags.includes('fail') || n.flags.includes('fail?') || n.flags.includes('handshake');
      if (v.some((n) => failing(n) && live.some((l) => l.port === n.port))) return false;
      const served = v.flatMap((n) => n.slots.map(([a, b]) => `${a}-${b}@${n.id}`)).sort();
      views.push(served.join(','));
    }
    return views.length > 0 && views.every((s) => s === views[0]);
  }

  const handle: RedisClusterHandle = {
    nodes,
    startupNodes: nodes.map((n) => ({ host: '127.0.0.1', port: n.port })),
    view,
    async masterOf(slot) {
      const master = (await view()).find(
        (n) =>
          n.flags.includes('master') && !n.flags.includes('fail') && n.slots.some(([a, b]) => slot >= a && slot <= b),
      );
      if (!master) throw new Error(`no master serves slot ${slot}`);
      return byPort(master.port);
    },
    async replicaOf(masterId) {
      const replica = (await view()).find((n) => n.masterId === masterId && !n.flags.includes('fail'));
      if (!replica) throw new Error(`master ${masterId} has no replica`);
      return byPort(replica.port);
    },
    async nodeId(node) {
      return String(await node.admin().cluster('MYID'));
    },
    async keyslot(key) {
      const live = nodes.find((n) => n.running && !paused.has(n.port));
      if (!live) throw new Error('no live node');
      return Number(await live.admin().cluster('KEYSLOT', key));
    },
    async waitStable(timeout = timeoutMs) {
      await waitFor('the Redis Cluster to be stable', timeout, stableOnce);
    },
    async heal(timeout = timeoutMs) {
      for (const node of nodes) if (paused.has(node.port)) node.resume();
      for (const node of nodes) await node.start();
      // Restarted nodes rejoin from their nodes.conf; wait until they are known again, none is failing
      // and a failed-over master has become its successor's replica (the next test may need a replica
      // of every master; a rejoining node shows as an empty master for a while first).
      await waitFor('every node to rejoin as master or replica', timeout, async () => {
        const v = await view();
        const masters = v.filter((n) => n.flags.includes('master') && n.slots.length > 0);
        const replicated = masters.every((m) => v.some((n) => n.masterId === m.id && !n.flags.includes('fail')));
        return v.length === nodes.length && replicated && (await stableOnce());
      });
    },
    async stop() {
      for (const client of admins.values()) client.disconnect();
      await Promise.all(nodes.map((n) => n.kill()));
      await rm(dir, { recursive: true, force: true });
    },
  };

  try {
    for (const node of nodes) await node.start();
    await create(nodes.map((n) => n.address));
    await handle.waitStable(timeoutMs);
    await waitFor('every replica to be in sync', timeoutMs, async () => {
      const v = await view();
      return v.filter((n) => n.flags.includes('slave')).length === 3;
    });
  } catch (err) {
    await handle.stop();
    throw err;
  }
  return handle;
}

/** `redis-cli --cluster create`, bounded in time. */
async function create(addresses: string[]): Promise<void> {
  const cli = spawn('redis-cli', ['--cluster', 'create', ...addresses, '--cluster-replicas', '1', '--cluster-yes'], {
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  cli.stdout?.on('data', (chunk) => {
    output = (output + chunk).slice(-4000);
  });
  cli.stderr?.on('data', (chunk) => {
    output = (output + chunk).slice(-4000);
  });
  const code = await new Promise<number | null>((resolve) => {
    const timer = setTimeout(() => cli.kill('SIGKILL'), 30_000);
    cli.once('exit', (c) => {
      clearTimeout(timer);
      resolve(c);
    });
  });
  if (code !== 0) throw new Error(`redis-cli --cluster create failed (${code}):\n${output}`);
}

function parseNodes(text: string): NodeView[] {
  return text
    .trim()
    .split('\n')
    .filter(Boolean)
    .map((line) => {
      const [id = '', addr = '', flags = '', master = '-', , , , , ...slots] = line.trim().split(/\s+/);
      const hostPort = addr.split('@')[0] ?? '';
      return {
        id,
        address: hostPort,
        port: Number(hostPort.split(':')[1]),
        flags: flags.split(','),
        masterId: master === '-' ? null : master,
        slots: slots
          .filter((s) => !s.startsWith('['))
          .map((s) => {
            const [a, b] = s.split('-');
            return [Number(a), Number(b ?? a)] as [number, number];
          }),
      };
    });
}

/** Polls `probe` until it returns true: at most `timeoutMs` and 1,000 tries. */
export async function waitFor(what: string, timeoutMs: number, probe: () => Promise<boolean>): Promise<void> {
  const until = Date.now() + timeoutMs;
  let last: unknown;
  for (let i = 0; i < 1_000 && Date.now() < until; i++) {
    try {
      if (await probe()) return;
    } catch (err) {
      last = err;
    }
    await sleep(100);
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${last ? `: ${String(last)}` : ''}`);
}
