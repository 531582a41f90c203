/**
 * The chaos run: N worker processes (scripts/chaos-worker.ts) increment one
 * fenced counter under one lock while a nemesis injects real faults; then a
 * Jepsen-style checker reads the history and the audit table.
 *
 * ```sh
 * npm run chaos -- --backend redis|postgres|advisory --workers 4 --seconds 20 [--ttl 1000] [--out DIR] [--seed N]
 * npm run chaos -- --backend etcd --ttl 2000 …
 * npm run chaos -- --backend redis --nemesis replication [--namespaces 50] [--min-failbacks 2] …
 * ```
 *
 * Faults, at random intervals (seeded; the timing itself is the machine's):
 * - SIGSTOP of the worker that holds the lock, between its acquire and its
 *   write, for 1.2–3 TTLs and on until a newer holder's write landed (at
 *   most 3 TTLs more), then SIGCONT — it wakes up stale and writes (the
 *   worker says when its hold ends, so a pause does not land in its write);
 * - kill -9 of a worker (often the holder, in its hold or its write),
 *   restarted under the same label;
 * - redis: FLUSHDB of, or kill -9 and restart of, a redis-server this runner
 *   started itself on a free loopback port (the shared 6379 is never used);
 * - postgres / advisory: `pg_terminate_backend` of the holder's connections
 *   (its pool, and for advisory the session that holds the lock);
 * - etcd: the runner starts a 3-member cluster of its own (1 s election
 *   timeout) and kills one member (kill -9, often the leader), restarting it
 *   on its data after 0.5–2 TTLs, or SIGSTOPs the leader for 1.2–3 TTLs (the
 *   others elect a new one; the old one wakes up still thinking it leads);
 * - every backend: `partition`, a network partition of the holder (or, when
 *   none holds, a random worker; one drawn partition in three cuts off a
 *   worker waiting in acquire instead) for 1.2–3 TTLs. Each worker reaches
 *   Postgres, and its Redis or every etcd member, through loopback TCP proxies of its own
 *   (scripts/chaos-network.ts, kept across its restarts); the partition
 *   SIGSTOPs them, then SIGCONT. Unlike a pause, the worker's process runs
 *   on: its lease runs out locally, its lock-manager calls fail with
 *   CommandTimeoutError, and the bytes it sent meanwhile — a grant, a
 *   release, a fenced write — reach the server late, after the partition.
 *   The report counts the partitions that caught the holder, and those whose
 *   holder's write was answered only after the heal;
 * - every backend: `source`, the database given a new fence source id
 *   (`palisade.fence_sources`) while the workers' managers run, once by
 *   mid-run at least, on Redis followed by a FLUSHDB (its next epoch is the
 *   first under the new id). The checker holds each lock's grants to naming
 *   their sources in fence order; a run where no worker running since before
 *   a change was granted under the new id failed to bite. On etcd the change
 *   is the operator's step after a restore: the namespace's source key
 *   deleted (the nemesis then puts the new mark itself, or finds the one a
 *   grant put);
 * - redis `--nemesis replication`: the runner owns a primary and a replica
 *   (two redis-servers, each its own `--dir`) and tells the workers which is
 *   the primary (a line on their stdin). Failover: the replica is promoted,
 *   some workers (maybe none) are told at once while the others go on
 *   granting on the old primary for 0.3–1.5 s — a split brain — then the old
 *   primary is made a replica of the new one (a full resync) and everyone is
 *   told. Failback: the same, then at once the old primary is promoted back
 *   and the other follows it (the old primary now holds the other's, older,
 *   counter under its own run_id). Also: the replica restarted empty (a full
 *   resync), the primary restarted empty, FLUSHALL, pauses and kills. The
 *   report counts failovers, failbacks and the grants on each side of every
 *   split brain; a run with fewer than `--min-failbacks` failbacks, or without
 *   grants on both sides of a split brain, failed to bite.
 *
 * With `--namespaces N` (redis) every worker runs one loop per namespace, each
 * its own lock and counter row: a flush or restart makes all N namespaces
 * recover their fence epoch at the same moment.
 *
 * Each run gets a fresh database (CREATE DATABASE on DATABASE_URL, dropped
 * afterwards unless `--keep`) and a namespace of its own. When the time is
 * up the faults stop, every worker is resumed and asked to stop, a `probe`
 * acquire waits at most one TTL, and `checkHistory` judges. Exit status 1
 * on any anomaly, or if no stale write was rejected (the faults did not
 * bite); 2 on a usage error.
 *
 * The replication nemesis has no partitions, and its workers no proxies: they
 * talk to the servers whose ports the runner names.
 */
import { type ChildProcess, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { closeSync, mkdirSync, mkdtempSync, openSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';
import { drizzle } from 'drizzle-orm/postgres-js';
import { Etcd3 } from 'etcd3';
import { Redis } from 'ioredis';
import postgres from 'postgres';
import type { Database } from '../src/driver.js';
import { etcdKeyNames } from '../src/fencing/backends/etcd/keys.js';
import { sourceKeyRequest } from '../src/fencing/backends/etcd/source.js';
import { redisLockManager } from '../src/fencing/backends/redis/manager.js';
import type { LockManager } from '../src/fencing/lock-manager.js';
import { migrate } from '../src/migrate.js';
import { type AuditRow, checkHistory, formatReport, type Report } from '../src/testing/checker.js';
import { type HistoryEvent, historyRecorder, historyTime, readHistory } from '../src/testing/history.js';
import { type EtcdCluster, type EtcdMember, startEtcdCluster } from '../test/support/etcd-cluster.js';
import { openManager } from '../test/support/managers.js';
import { type PrivateRedis, startPrivateRedis } from '../test/support/redis-server.js';
import { createScratchDatabase } from '../test/support/scratch-database.js';
import { sleep } from '../test/support/sleep.js';
import { type ChaosProxy, startChaosProxy, throughProxy } from './chaos-network.js';
import { renderChaosReport, type SavedReport } from './chaos-report/render.js';
import { CHAOS_DDL, type ChaosSlot, type ChaosWorkerArgs, chaosKeys, chaosSlots } from './chaos-worker.js';

/** Backends the chaos run knows how to fault. */
export type ChaosBackend = 'redis' | 'postgres' | 'advisory' | 'etcd';
/** Which faults: the backend's own (`standard`), or Redis failovers and failbacks (`replication`, redis only). */
export type ChaosNemesis = 'standard' | 'replication';

/** Options of {@link runChaos}. */
export interface ChaosOptions {
  readonly backend: ChaosBackend;
  readonly workers: number;
  readonly seconds: number;
  /** Lease TTL (default 1000 ms). Pauses and partitions last 1.2–3 TTLs. */
  readonly ttlMs?: number;
  /** Longest hold between acquire and write (default TTL / 2): the window a pause lands in. */
  readonly holdMs?: number;
  /** Where history.jsonl, nemesis.jsonl, report.txt, report.json, report.html and worker logs go (default: a new temp directory). */
  readonly out?: string;
  /** Base URL of the real Postgres; each run creates (and drops) a database of its own there. */
  readonly databaseUrl: string;
  /** Seeds the nemesis' choices (default: random, printed in the report). */
  readonly seed?: number;
  /** Workers skip the write when their lease's signal fired (default false: the database must refuse). */
  readonly checkSignal?: boolean;
  /** Keep the run's database for inspection. */
  readonly keepDatabase?: boolean;
  /** Progress lines (default: none). */
  readonly log?: (line: string) => void;
  /** Default `standard`; `replication` needs the redis backend. */
  readonly nemesis?: ChaosNemesis;
  /** Redis only: namespaces, each with its own lock and counter row (default 1). */
  readonly namespaces?: number;
  /** The replication nemesis: the fewest failbacks a run must make (default 2). */
  readonly minFailbacks?: number;
}

/** What the replication nemesis did, and the grants on each side of its split brains. */
export interface ReplicationSummary {
  readonly failovers: number;
  /** Failovers back to a server that had been the primary before. */
  readonly failbacks: number;
  readonly splitBrains: number;
  /** Grants by the old primary while the new one was already promoted. */
  readonly grantsOnOldPrimary: number;
  /** Grants by the new primary while the old one was not yet demoted. */
  readonly grantsOnNewPrimary: number;
}

/** What a chaos run found. */
export interface ChaosResult {
  readonly report: Report;
  /** The report as printed: the run's settings, faults, checker findings and the command to reproduce it. */
  readonly text: string;
  /** No anomalies, at least one stale write rejected. */
  readonly ok: boolean;
  readonly outDir: string;
  readonly faults: Readonly<Record<string, number>>;
  /** Of those, the ones that caught a worker holding the lock, by kind (`pause`, `partition`): the faults that make stale writes. */
  readonly holderFaults: Readonly<Record<string, number>>;
  /**
   * Partitions of a holder whose write (with the fence it held) was answered only after the partition
   * healed: the write was held up on the network while the process ran on — the partition really cut
   * the worker off (a worker that bypassed its proxies would have been answered at once).
   */
  readonly partitionedWrites: number;
  /** The counter's final value. */
  readonly counter: number;
  /** Workers that exited without being killed or stopped (restarted, and reported). */
  readonly crashes: readonly string[];
  /** The replication nemesis only. */
  readonly replication?: ReplicationSummary;
}

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const WORKER = join(ROOT, 'scripts', 'chaos-worker.ts');
const LOCK = 'chaos:counter';
const KEY = 'c';
/**
 * Pauses of a worker holding the lock a run aims for (outside the replication nemesis): behind that
 * pace (one per quarter of the run), its next fault is a pause — or a partition, if those are further
 * behind — and faults go on past the run's length (up to twice it) while some are still due. Not a
 * guarantee — a pause finds no holder when none holds within 2 TTLs — which is why a run also fails
 * when no fault bit.
 */
const MIN_HOLDER_PAUSES = 3;
/** Likewise for partitions of a holder (due at a third and two thirds of the run, after any pause that is due). */
const MIN_HOLDER_PARTITIONS = 2;

interface Handle {
  readonly label: string;
  child: ChildProcess;
  /**
   * What the worker last told us: `holding` from `acquired` to the end of its hold, `writing` from then
   * to `wrote`. A pause or partition aims at the hold: caught in the write, a holder is ended by the idle
   * timeout or by the next holder's raise (an unknown write, not a refused one), so it would not show
   * the database refusing it.
   */
  state: 'starting' | 'idle' | 'holding' | 'writing' | 'wrote' | 'exited';
  fence: string | undefined;
  exited: Promise<void>;
  ready: Promise<void>;
  /** Set before the runner kills or stops it: any other exit is a crash. */
  expectExit: boolean;
}

/** Runs one chaos run and returns the checker's report. Never throws for an anomaly: read `ok`. */
export async function runChaos(options: ChaosOptions): Promise<ChaosResult> {
  const o = checkOptions(options);
  const log = options.log ?? (() => {});
  const seed = options.seed ?? randomBytes(4).readUInt32LE(0);
  const random = mulberry32(seed);
  const between = (lo: number, hi: number) => lo + random() * (hi - lo);
  if (options.out) mkdirSync(options.out, { recursive: true });
  const outDir = options.out ?? mkdtempSync(join(tmpdir(), `palisade-chaos-${o.backend}-`));
  const historyPath = join(outDir, 'history.jsonl');
  writeFileSync(historyPath, '');
  writeFileSync(join(outDir, 'nemesis.jsonl'), '');
  const nemesisRecord = historyRecorder(join(outDir, 'nemesis.jsonl'), 'nemesis');
  const historyNemesis = historyRecorder(historyPath, 'nemesis');
  const namespace = `chaos-${randomBytes(4).toString('hex')}`;
  const faults: Record<string, number> = {};
  const fault = (kind: string, detail: string) => {
    faults[kind] = (faults[kind] ?? 0) + 1;
    nemesisRecord({ type: 'ok', op: 'nemesis', reason: `${kind}: ${detail}` });
    historyNemesis({ type: 'ok', op: 'nemesis', reason: `${kind}: ${detail}` });
    log(`nemesis: ${kind} ${detail}`);
  };

  const scratch = await createScratchDatabase(o.databaseUrl, 'palisade_chaos');
  const dbName = scratch.name;
  const runUrl = scratch.url;
  const client = postgres(runUrl, { max: 2, onnotice: () => {} });
  const db = drizzle(client) as unknown as Database;
  const slots = chaosSlots(namespace, LOCK, KEY, o.namespaces);
  // The Redis servers the run owns: one, or a primary and a replica (the replication nemesis).
  let redis: PrivateRedis | undefined;
  let topology: { primary: PrivateRedis; replica: PrivateRedis } | undefined;
  const redisAdmins = new Map<PrivateRedis, Redis>();
  const redisAdmin = (server: PrivateRedis): Redis => {
    let r = redisAdmins.get(server);
    if (!r) {
      r = new Redis(server.port, '127.0.0.1', { commandTimeout: 10_000, maxRetriesPerRequest: 2 });
      r.on('error', () => {});
      redisAdmins.set(server, r);
    }
    return r;
  };
  const replication = { failovers: 0, failbacks: 0 };
  /** Grants the workers reported, per Redis server (their `acquired` lines), as they happen. */
  const grantsSeen = new Map<string, number>();
  /** The highest fence any worker reported written (`applied`): a paused holder below it will write stale. */
  let newestApplied = -1n;
  const splitBrains: { from: number; to: number; old: string; new: string }[] = [];
  const handles: Handle[] = [];
  const crashes: string[] = [];
  /** The etcd cluster the run owns (etcd backend). */
  let cluster: EtcdCluster | undefined;
  /** Each worker label's proxies (Postgres, then Redis or each etcd member): one set per label for the whole run. */
  const network = new Map<string, ChaosProxy[]>();
  // Until the workers are up, a crash is restarted as during the run.
  let deadline = Date.now() + o.seconds * 1000 + 120_000;
  try {
    await migrate(db);
    for (const ddl of CHAOS_DDL) await client.unsafe(ddl);
    for (const slot of slots) {
      for (const key of chaosKeys(slot.key)) await client`insert into chaos_counter (id, n) values (${key}, 0)`;
    }
    if (o.nemesis === 'replication') {
      // Each its own --dir (startPrivateRedis); a full resync starts at once instead of after 5 s.
      const pair = [await startPrivateRedis(PROMPT_SYNC), await startPrivateRedis(PROMPT_SYNC)] as const;
      topology = { primary: pair[0], replica: pair[1] };
      await redisAdmin(pair[1]).replicaof('127.0.0.1', String(pair[0].port));
      await inSync(redisAdmin(pair[1]));
      redis = pair[0];
    } else if (o.backend === 'redis') redis = await startPrivateRedis();
    else if (o.backend === 'etcd') cluster = await startEtcdCluster(3);
    log(
      `database ${dbName}, namespace ${namespace}${o.namespaces > 1 ? ` (×${o.namespaces})` : ''}${topology ? `, redis primary ${topology.primary.port} and replica ${topology.replica.port}` : redis ? `, redis-server on ${redis.url}` : ''}, out ${outDir}`,
    );

    // The standard nemesis partitions workers: each gets proxies of its own, started once, before it.
    if (!topology) {
      // Past every worker's own bound (start, run, maxRunMs, drain), yet bounded should this run fail to end them.
      const exitAfterMs = o.seconds * 1000 + 600_000;
      const targets: [string, number][] = [['Postgres', Number(new URL(runUrl).port || 5432)]];
      if (redis) targets.push(['Redis', redis.port]);
      for (const member of cluster?.members ?? [])
        targets.push([etcdProxyName(member), Number(new URL(member.clientUrl).port)]);
      // All at once (each is a process that takes a while to start); every one started is kept, to be ended.
      const starts = Array.from({ length: o.workers }, (_, i) => `w${i + 1}`).flatMap((label) =>
        targets.map(async ([name, port]) => {
          const proxy = await startChaosProxy(name, port, exitAfterMs, join(outDir, `${label}.proxy.stderr.log`));
          network.set(label, [...(network.get(label) ?? []), proxy]);
        }),
      );
      const failed = (await Promise.allSettled(starts)).find((r) => r.status === 'rejected');
      if (failed) throw failed.reason;
    }
    const proxied = (label: string, name: string, url: string) => {
      const proxy = network.get(label)?.find((p) => p.name === name);
      return proxy ? throughProxy(url, proxy) : url;
    };
    const workerArgs = (label: string): ChaosWorkerArgs => ({
      kind: o.backend,
      namespace,
      databaseUrl: proxied(label, 'Postgres', runUrl),
      ...(redis ? { redisUrl: proxied(label, 'Redis', redis.url) } : {}),
      ...(cluster
        ? {
            etcdEndpoints: cluster.members.map((m) => proxied(label, etcdProxyName(m), m.clientUrl).replace(/\/$/, '')),
          }
        : {}),
      ...(topology
        ? { redisPorts: [topology.primary.port, topology.replica.port].sort(), primary: topology.primary.port }
        : {}),
      ...(o.namespaces > 1 ? { namespaces: o.namespaces } : {}),
      process: label,
      lock: LOCK,
      key: KEY,
      ttlMs: o.ttlMs,
      waitMs: 3 * o.ttlMs,
      holdMs: o.holdMs,
      history: historyPath,
      checkSignal: options.checkSignal === true,
      maxRunMs: o.seconds * 1000 + 120_000,
    });
    const spawnWorker = (label: string): Handle => {
      const stderr = openSync(join(outDir, `${label}.stderr.log`), 'a');
      const child = spawn(process.execPath, ['--import', 'tsx', WORKER, JSON.stringify(workerArgs(label))], {
        cwd: ROOT,
        // Names the worker's Postgres connections, so the nemesis can terminate them.
        env: { ...process.env, PGAPPNAME: `chaos-${label}` },
        stdio: ['pipe', 'pipe', stderr],
      });
      closeSync(stderr);
      const handle: Handle = {
        label,
        child,
        state: 'starting',
        fence: undefined,
        exited: new Promise((resolve) => child.once('exit', () => resolve())),
        ready: Promise.resolve(),
        expectExit: false,
      };
      handle.ready = new Promise((resolve) => {
        child.once('exit', () => resolve());
        createInterface({ input: child.stdout as NodeJS.ReadableStream }).on('line', (line) => {
          let m: { event?: string; fence?: string; server?: string; status?: string };
          try {
            m = JSON.parse(line);
          } catch {
            return;
          }
          if (m.event === 'ready') {
            handle.state = 'idle';
            resolve();
          } else if (m.event === 'acquired') {
            handle.state = 'holding';
            handle.fence = m.fence;
            if (m.server) grantsSeen.set(m.server, (grantsSeen.get(m.server) ?? 0) + 1);
          } else if (m.event === 'writing') {
            handle.state = 'writing';
          } else if (m.event === 'wrote' || m.event === 'skipped') {
            handle.state = 'wrote';
            if (m.status === 'applied' && m.fence && BigInt(m.fence) > newestApplied) newestApplied = BigInt(m.fence);
          } else if (m.event === 'released') handle.state = 'idle';
        });
      });
      void handle.exited.then(() => {
        handle.state = 'exited';
        if (!handle.expectExit) {
          // Not our doing: a bug in the worker's stack. Counted, reported, and the worker restarted.
          crashes.push(
            `${label} exited on its own (code ${child.exitCode}, signal ${child.signalCode}): ${lastError(join(outDir, `${label}.stderr.log`))}`,
          );
          log(`worker ${label} crashed; see ${join(outDir, `${label}.stderr.log`)}`);
          if (Date.now() < deadline) {
            const index = handles.indexOf(handle);
            if (index >= 0) handles[index] = spawnWorker(label);
          }
        }
      });
      return handle;
    };

    for (let i = 0; i < o.workers; i++) handles.push(spawnWorker(`w${i + 1}`));
    await withTimeout(Promise.all(handles.map((h) => h.ready)), 120_000, 'workers did not start');
    log(`${o.workers} workers ready; faults for ${o.seconds} s`);

    // The nemesis: one fault at a time until the deadline.
    deadline = Date.now() + o.seconds * 1000;
    const sleepUntil = (ms: number) => sleep(Math.max(0, Math.min(ms, deadline - Date.now())));
    /** A worker in its hold, or with `writing`, in its hold or its write. */
    const holder = async (within: number, writing = false): Promise<Handle | undefined> => {
      const until = Date.now() + within;
      while (Date.now() < until) {
        const h = handles.find((x) => x.state === 'holding' || (writing && x.state === 'writing'));
        if (h) return h;
        await sleep(5);
      }
      return undefined;
    };
    const kinds = topology
      ? ['pause', 'kill', 'failover', 'failback', 'resync', 'restart', 'flush']
      : o.backend === 'redis'
        ? ['pause', 'pause', 'kill', 'flush', 'restart', 'partition', 'partition', 'source']
        : o.backend === 'etcd'
          ? ['pause', 'pause', 'kill', 'member-kill', 'member-pause', 'partition', 'partition', 'source']
          : ['pause', 'pause', 'kill', 'terminate', 'terminate', 'partition', 'partition', 'source'];
    const started = Date.now();
    let failedOver = false;
    // Pauses and partitions that caught a worker holding the lock: the faults that make stale writes.
    const holderFaults: Record<string, number> = {};
    const caught = (kind: string) => holderFaults[kind] ?? 0;
    // Holder pauses that ended with no newer write landed, 3 TTLs past their length: the lock stayed out of
    // reach for that long (a paused holder wedging it, or a machine too loaded). Reported, not judged.
    let unfollowedPauses = 0;
    /** The fence source ids the run gave the database, and when (on the history's clock). */
    const sourceChanges: { id: string; time: number }[] = [];
    // Redis names a new id from its next epoch on: a flush follows each change there.
    let flushDue = false;
    /** Partitions that caught a holder: who, its fence, and when (on the history's clock). */
    const holderPartitions: { label: string; fence: string | undefined; to: number }[] = [];
    const tell = (to: readonly Handle[], server: PrivateRedis) => {
      for (const h of to)
        if (h.state !== 'exited') h.child.stdin?.write(`${JSON.stringify({ primary: server.port })}\n`);
    };
    /**
     * Promotes the replica while the old primary goes on granting to the workers not told yet (a split
     * brain of 1.2–3 TTLs), then makes the old primary a replica of the new one (a full resync). With
     * `back`, the old primary is promoted again at once and the other follows it: the failback.
     */
    const failover = async (back: boolean) => {
      if (!topology) return;
      const { primary: old, replica: next } = topology;
      await redisAdmin(next).replicaof('NO', 'ONE');
      const from = historyTime();
      replication.failovers++;
      // A failback's workers stay on the old primary (maybe all of them): nobody grants on the new one.
      const early = handles.filter(() => random() < (back ? 0.25 : 0.5));
      if (back && random() < 0.5) early.length = 0;
      // A failover always moves someone at once, so that both sides grant during the split.
      if (!back && early.length === 0) early.push(handles[Math.floor(random() * handles.length)] as Handle);
      tell(early, next);
      const grantedBefore = grantsSeen.get(String(next.port)) ?? 0;
      // Long enough for the lock keys the new primary replicated to expire, so that both sides grant …
      await sleep(between(1.2, 3) * o.ttlMs);
      // … and, in a failover, until the new primary has granted at least once (bounded: 5 TTLs more).
      for (let i = 0; !back && i < 250 && (grantsSeen.get(String(next.port)) ?? 0) === grantedBefore; i++) {
        await sleep(o.ttlMs / 50);
      }
      await redisAdmin(old).replicaof('127.0.0.1', String(next.port));
      splitBrains.push({ from, to: historyTime(), old: String(old.port), new: String(next.port) });
      topology = { primary: next, replica: old };
      if (back) {
        await inSync(redisAdmin(old));
        await redisAdmin(old).replicaof('NO', 'ONE');
        await redisAdmin(next).replicaof('127.0.0.1', String(old.port));
        replication.failovers++;
        replication.failbacks++;
        topology = { primary: old, replica: next };
        tell(handles, old);
        fault(
          'failback',
          `${next.port} promoted, ${early.length} worker(s) told; ${old.port} granted on, was resynced from it and promoted back`,
        );
        await inSync(redisAdmin(next));
      } else {
        if (replication.failovers > 1) replication.failbacks++; // two servers: every later failover goes back
        tell(handles, next);
        fault('failover', `${next.port} promoted, ${early.length} worker(s) told at once; ${old.port} demoted after`);
        await inSync(redisAdmin(old));
      }
    };
    // How far a kind of holder fault is behind its pace (MIN of them spread over the run): > 0 when one is due.
    const behind = (kind: string, min: number) =>
      topology || caught(kind) >= min
        ? 0
        : ((Date.now() - started) / (o.seconds * 1000)) * (min + 1) - caught(kind) - 1;
    // At the deadline, holder faults still due move it on by a second at a time, up to twice the run's length:
    // on a loaded machine, pauses that took their longest could leave no time for a partition of the holder.
    const lastDeadline = deadline + o.seconds * 1000;
    const extend = () => {
      if (
        deadline >= lastDeadline ||
        (behind('pause', MIN_HOLDER_PAUSES) <= 0 && behind('partition', MIN_HOLDER_PARTITIONS) <= 0)
      ) {
        return false;
      }
      deadline = Math.min(lastDeadline, deadline + 1000);
      log('nemesis: holder faults still due at the deadline; faults go on for another second');
      return true;
    };
    while (Date.now() < deadline || extend()) {
      await sleepUntil(between(200, 800));
      if (Date.now() >= deadline && !extend()) break;
      let kind = kinds[Math.floor(random() * kinds.length)] as string;
      // A partition the run's minimum calls for (below) must catch a holder; only a drawn one may not.
      let partitionDrawn = kind === 'partition';
      // MIN_HOLDER_PAUSES pauses and MIN_HOLDER_PARTITIONS partitions of a holder, spread over the run, the
      // one furthest behind first: on a loaded machine, a random draw of a few pauses that all found no
      // holder made a run where no fault could bite.
      const pauseLag = behind('pause', MIN_HOLDER_PAUSES);
      const partitionLag = behind('partition', MIN_HOLDER_PARTITIONS);
      if (pauseLag > 0 && pauseLag >= partitionLag) kind = 'pause';
      else if (partitionLag > 0) {
        kind = 'partition';
        partitionDrawn = false;
      }
      // On etcd, a member killed by a fifth of the run and the leader paused by two fifths, whatever the draws.
      const elapsed = (Date.now() - started) / (o.seconds * 1000);
      if (cluster && faults['member-kill'] === undefined && elapsed > 0.2) kind = 'member-kill';
      else if (cluster && faults['member-pause'] === undefined && elapsed > 0.4) kind = 'member-pause';
      // One id change by mid-run, outside the replication nemesis, so that grants follow it (one quick
      // statement: a holder fault due waits for the next turn); on Redis the flush that makes it bite.
      if (!topology && sourceChanges.length === 0 && Date.now() - started > o.seconds * 500) kind = 'source';
      if (flushDue) kind = 'flush';
      // The run's minimum of failbacks, spread over its length.
      const due = ((replication.failbacks + 1) / (o.minFailbacks + 1)) * o.seconds * 1000;
      if (topology && replication.failbacks < o.minFailbacks && Date.now() - started > due) kind = 'failback';
      // And one failover (not a failback) in the first fifth, with workers on both sides of its split brain.
      if (topology && !failedOver && Date.now() - started > o.seconds * 200) kind = 'failover';
      try {
        if (kind === 'failover' || kind === 'failback') {
          if (kind === 'failover') failedOver = true;
          const began = Date.now();
          await failover(kind === 'failback');
          log(`nemesis: ${kind} took ${Date.now() - began} ms`);
          continue;
        }
        if (kind === 'resync' && topology) {
          const { primary, replica } = topology;
          fault('resync', `replica ${replica.port} restarted empty, full resync from ${primary.port}`);
          await replica.restart();
          await redisAdmin(replica).replicaof('127.0.0.1', String(primary.port));
          await inSync(redisAdmin(replica));
          continue;
        }
        if (kind === 'restart' && topology) {
          fault('restart', `kill -9 and restart of the primary ${topology.primary.port} (empty; its replica resyncs)`);
          await topology.primary.restart();
          await inSync(redisAdmin(topology.replica));
          continue;
        }
        if (kind === 'flush' && topology) redis = topology.primary;
      } catch (err) {
        log(`nemesis: ${kind} failed: ${String(err)}`);
        continue;
      }
      if (kind === 'pause') {
        const h = (await holder(2 * o.ttlMs)) ?? handles[Math.floor(random() * handles.length)];
        if (!h || h.state === 'exited') continue;
        const ms = Math.round(between(1.2, 3) * o.ttlMs);
        if (h.state === 'holding') holderFaults.pause = caught('pause') + 1;
        fault('pause', `${h.label} (${h.state}${h.state === 'holding' ? ` fence ${h.fence}` : ''}) for ${ms} ms`);
        h.child.kill('SIGSTOP');
        await sleep(ms);
        // A pause that outlasted the lease can still miss: the next holder may not have written yet, and then
        // the paused one's write is simply first (a run once saw no stale write at all). So a paused holder
        // stays stopped until a newer fence's write landed, as a long GC pause would, at most 3 TTLs more.
        const fence = h.state === 'holding' && h.fence !== undefined ? BigInt(h.fence) : undefined;
        const until = Date.now() + 3 * o.ttlMs;
        while (fence !== undefined && newestApplied <= fence && Date.now() < until) await sleep(10);
        if (fence !== undefined && newestApplied <= fence) unfollowedPauses++;
        if (fence !== undefined)
          log(`nemesis: ${h.label} resumed ${newestApplied > fence ? 'after' : 'before'} a newer write`);
        h.child.kill('SIGCONT');
      } else if (kind === 'partition') {
        // Mostly the holder: its write is held up and reaches the database late, stale. One drawn partition
        // in three cuts off a worker waiting in acquire instead: a holder makes no lock-manager call while
        // its write is held up, a waiter's grant is in flight — it times out (CommandTimeoutError) and
        // lands late, after the heal, when the lock manager must give it back.
        const waiting = handles.filter((x) => x.state === 'idle');
        const h =
          (partitionDrawn && random() < 1 / 3 ? waiting[Math.floor(random() * waiting.length)] : undefined) ??
          (await holder(2 * o.ttlMs)) ??
          handles[Math.floor(random() * handles.length)];
        const proxies = h ? (network.get(h.label) ?? []) : [];
        if (!h || h.state === 'exited' || proxies.length === 0) continue;
        const ms = Math.round(between(1.2, 3) * o.ttlMs);
        if (h.state === 'holding') holderFaults.partition = caught('partition') + 1;
        fault(
          'partition',
          `${h.label} (${h.state}${h.state === 'holding' ? ` fence ${h.fence}` : ''}) for ${ms} ms: its ${proxies
            .map((p) => p.name)
            .sort()
            .join(' and ')} connections frozen, its process running`,
        );
        const held = h.state === 'holding' ? { label: h.label, fence: h.fence } : undefined;
        for (const p of proxies) p.freeze();
        try {
          await sleep(ms);
        } finally {
          // Stamped before the SIGCONT: nothing sent through a frozen proxy can be answered earlier.
          if (held) holderPartitions.push({ ...held, to: historyTime() });
          for (const p of proxies) p.heal();
        }
      } else if (kind === 'kill') {
        const h =
          (random() < 0.5 ? await holder(o.ttlMs, true) : undefined) ?? handles[Math.floor(random() * handles.length)];
        if (!h) continue;
        fault('kill', `${h.label} (${h.state}) with SIGKILL, restarted`);
        h.expectExit = true;
        h.child.kill('SIGCONT');
        h.child.kill('SIGKILL');
        await withTimeout(h.exited, 10_000, `${h.label} did not die`);
        await sleep(between(100, 500));
        const index = handles.indexOf(h);
        const fresh = spawnWorker(h.label);
        handles[index] = fresh;
        // Not awaited: the faults go on while it starts (seconds on a busy machine); the drain waits for its exit.
      } else if (kind === 'flush' && redis) {
        const r = new Redis(redis.url, { maxRetriesPerRequest: 1, lazyConnect: true });
        r.on('error', () => {});
        try {
          await r.connect();
          if (topology) await r.flushall();
          else await r.flushdb();
          fault(
            'flush',
            `${topology ? 'FLUSHALL on the primary' : 'FLUSHDB on the private redis-server'} (locks and fence counter gone)`,
          );
          flushDue = false;
        } catch (err) {
          log(`nemesis: FLUSHDB failed: ${String(err)}`);
        } finally {
          r.disconnect();
        }
      } else if (kind === 'restart' && redis) {
        fault('restart', 'kill -9 and restart of the private redis-server (no persistence: every key lost)');
        await redis.restart();
      } else if (kind === 'member-kill' && cluster) {
        // One member down at a time: the other two keep the quorum (a pause of the leader right after may not).
        const running = cluster.members.filter((m) => m.running);
        if (running.length < cluster.members.length) continue;
        const leader = random() < 0.5 ? await cluster.leader(2_000).catch(() => undefined) : undefined;
        const m = leader ?? (running[Math.floor(random() * running.length)] as EtcdMember);
        const ms = Math.round(between(0.5, 2) * o.ttlMs);
        fault(
          'member-kill',
          `etcd ${m.name}${leader ? ' (the leader)' : ''} with SIGKILL, restarted on its data after ${ms} ms`,
        );
        await m.kill();
        await sleep(ms);
        m.start();
      } else if (kind === 'member-pause' && cluster) {
        // The others elect a new leader; the old one, thawed, still thinks it leads until it hears of the new term.
        const leader = await cluster.leader(2_000).catch(() => undefined);
        if (!leader) continue;
        const ms = Math.round(between(1.2, 3) * o.ttlMs);
        fault('member-pause', `etcd leader ${leader.name} SIGSTOPped for ${ms} ms`);
        leader.freeze();
        try {
          await sleep(ms);
        } finally {
          leader.thaw();
        }
      } else if (kind === 'source' && cluster) {
        // The operator's step after a restore (README, "etcd"): the namespace's source key deleted while the
        // managers run; the next grant, or this run first, puts a new mark, which every grant names from then on.
        const change = await newEtcdSource(cluster, namespace);
        sourceChanges.push(change);
        fault('source', `the namespace's etcd source key deleted, new mark ${change.id}, managers running`);
      } else if (kind === 'source') {
        // An operator gives the database a new fence source id while the managers run: from then on every
        // grant must name it, whichever manager grants it (Postgres grants at once, Redis from its next epoch).
        const [row] = await client<{ id: string }[]>`
          update palisade.fence_sources set source_id = 'pg:' || md5(random()::text) returning source_id as id`;
        sourceChanges.push({ id: row?.id ?? '', time: historyTime() });
        flushDue = o.backend === 'redis';
        fault('source', `the database's fence source id changed to ${row?.id}, managers running`);
      } else if (kind === 'terminate') {
        const h = await holder(2 * o.ttlMs, true);
        if (!h) continue;
        const [row] = await client<{ n: string }[]>`
          select count(*) filter (where pg_terminate_backend(pid)) as n from pg_stat_activity
          where datname = current_database() and pid <> pg_backend_pid()
            and (application_name = ${`chaos-${h.label}`} or application_name like ${`pl:${h.fence}:%`})`;
        fault('terminate', `pg_terminate_backend of ${row?.n ?? 0} connection(s) of ${h.label} (fence ${h.fence})`);
      }
    }

    // Faults off: resume everyone, ask them to stop, wait (bounded), then kill stragglers.
    log('faults stopped; draining workers');
    for (const proxies of network.values()) for (const p of proxies) p.heal();
    for (const h of handles) {
      h.expectExit = true;
      h.child.kill('SIGCONT');
      h.child.stdin?.write('stop\n');
    }
    const drain = 3 * o.ttlMs + o.holdMs + 30_000;
    const settled = await withTimeout(Promise.all(handles.map((h) => h.exited)), drain, 'drain').then(
      () => true,
      () => false,
    );
    if (!settled) {
      for (const h of handles) if (h.state !== 'exited') h.child.kill('SIGKILL');
      await Promise.all(handles.map((h) => h.exited));
      log('some workers did not stop in time and were killed');
    }

    log('workers stopped; probe');
    // Nothing wedged: an acquire per lock after the faults, each waiting at most one TTL.
    const probeRecord = historyRecorder(historyPath, 'probe');
    const probeWith = async (manager: LockManager, slot: ChaosSlot) => {
      probeRecord({ type: 'invoke', op: 'probe', lock: slot.lock });
      try {
        const lease = await manager.acquire(slot.lock, { ttlMs: o.ttlMs, waitMs: o.ttlMs, holder: 'probe' });
        probeRecord({ type: 'ok', op: 'probe', lock: slot.lock, fence: lease.fence.toString() });
        await lease.release();
      } catch (err) {
        probeRecord({
          type: 'fail',
          op: 'probe',
          lock: slot.lock,
          // The code and what it says: "lock_service" alone left a CI failure with nothing to go on.
          reason: `${String((err as { code?: unknown }).code ?? 'error')}: ${err instanceof Error ? err.message : String(err)}`,
        });
      }
    };
    if (redis && (topology || slots.length > 1)) {
      const primary = topology?.primary ?? redis;
      const r = new Redis(primary.port, '127.0.0.1', { commandTimeout: 2_000, maxRetriesPerRequest: 1 });
      r.on('error', () => {});
      try {
        // Connected before the first probe: its wait of one TTL is for the lock, not for a connection on a loaded machine.
        await r.ping().catch(() => {});
        for (const slot of slots) {
          const manager = redisLockManager({
            client: r,
            namespace: slot.namespace,
            epochs: db,
            commandTimeoutMs: 3_000,
          });
          await probeWith(manager, slot).finally(() => manager.close());
        }
      } finally {
        r.disconnect();
      }
    } else {
      // Every member back, and agreeing on a leader, before the probe's wait of one TTL.
      await cluster?.heal();
      const probe = await openManager({
        kind: o.backend,
        namespace,
        databaseUrl: runUrl,
        ...(redis ? { redisUrl: redis.url } : {}),
        ...(cluster ? { etcdEndpoints: cluster.endpoints } : {}),
      });
      try {
        await probeWith(probe.manager, slots[0] as ChaosSlot);
      } finally {
        await probe.close();
      }
    }

    log('probe done; checking');
    const audit =
      (await client`select id, key, fence, process, lock from chaos_audit order by id`) as unknown as AuditRow[];
    const counters: Record<string, number> = {};
    for (const row of await client<{ id: string; n: number }[]>`select id, n from chaos_counter`) {
      counters[row.id] = Number(row.n);
    }
    const counter = Object.values(counters).reduce((a, b) => a + b, 0);
    const history = readHistory(historyPath);
    const report = checkHistory({ history, audit, counters });
    let summary: ReplicationSummary | undefined;
    const missed: string[] = [];
    if (topology) {
      const grantsOn = (server: string, w: (typeof splitBrains)[number]) =>
        history.filter(
          (e) => e.op === 'acquire' && e.type === 'ok' && e.server === server && e.time >= w.from && e.time <= w.to,
        ).length;
      summary = {
        ...replication,
        splitBrains: splitBrains.length,
        grantsOnOldPrimary: splitBrains.reduce((n, w) => n + grantsOn(w.old, w), 0),
        grantsOnNewPrimary: splitBrains.reduce((n, w) => n + grantsOn(w.new, w), 0),
      };
      if (summary.failbacks < o.minFailbacks)
        missed.push(`only ${summary.failbacks} failbacks (at least ${o.minFailbacks})`);
      if (summary.grantsOnOldPrimary === 0) missed.push('no grant on an old primary during a split brain');
      if (summary.grantsOnNewPrimary === 0) missed.push('no grant on a new primary during a split brain');
    }
    // An id change bit when a worker running since before it (its manager read the old id) was granted
    // under the new one: a manager that named the id it had read would have named the old one.
    const runningSince = (e: HistoryEvent, time: number) =>
      !history.some((s) => s.process === e.process && s.op === 'start' && s.time > time && s.time < e.time);
    const sourcesNamed = sourceChanges.filter((c) =>
      history.some(
        (e) =>
          e.op === 'acquire' &&
          e.type === 'ok' &&
          e.time > c.time &&
          e.source?.endsWith(c.id) &&
          runningSince(e, c.time),
      ),
    ).length;
    if (!topology && sourcesNamed === 0)
      missed.push('no worker running since before a fence source id change was granted under the new id');
    // A worker's history label is its own, or `<label>.<i>` per namespace.
    const partitionedWrites = holderPartitions.filter((p) =>
      history.some(
        (e) =>
          (e.process === p.label || e.process.startsWith(`${p.label}.`)) &&
          e.op === 'increment' &&
          e.type !== 'invoke' &&
          e.fence === p.fence &&
          e.time >= p.to,
      ),
    ).length;
    const bit = report.staleWrites.rejected > 0;
    const ok = report.anomalies.length === 0 && bit && missed.length === 0;
    const faultLine = Object.entries(faults)
      .map(([k, n]) => {
        const ofHolder = holderFaults[k] === undefined ? '' : `${holderFaults[k]} of the lock holder`;
        const heldUp =
          k === 'partition'
            ? `; writes held up past the heal: ${partitionedWrites}`
            : k === 'pause'
              ? `; no newer write within 3 TTLs after: ${unfollowedPauses}`
              : '';
        return `${n} ${k}${ofHolder ? ` (${ofHolder}${heldUp})` : ''}`;
      })
      .join(', ');
    const text = [
      `palisade chaos run: backend ${o.backend}${o.nemesis === 'replication' ? ' (replication nemesis: a primary and a replica)' : ''}, ${o.workers} workers, ${o.namespaces > 1 ? `${o.namespaces} namespaces, ` : ''}${o.seconds} s of faults, TTL ${o.ttlMs} ms, hold ≤ ${o.holdMs} ms, seed ${seed}`,
      `faults injected: ${faultLine || 'none'}`,
      ...(sourceChanges.length > 0
        ? [
            `fence source id changes: ${sourceChanges.length}, ${sourcesNamed} of them named afterwards by a worker running since before`,
          ]
        : []),
      ...(summary
        ? [
            `replication: ${summary.failovers} failovers, ${summary.failbacks} failbacks; ${summary.splitBrains} split brains with ${summary.grantsOnOldPrimary} grants on the old primary and ${summary.grantsOnNewPrimary} on the new one`,
          ]
        : []),
      `counter${slots.length > 1 ? `s (sum of ${slots.length})` : ''}: ${counter} (audited increments: ${audit.length})`,
      formatReport(report),
      ...(crashes.length === 0
        ? ['worker processes that died on their own: 0']
        : [
            `worker processes that died on their own: ${crashes.length} (not a safety anomaly; a robustness bug):`,
            ...crashes.map((c) => `  - ${c}`),
          ]),
      ...(bit ? [] : ['0 stale writes rejected: the faults did not bite (a failed run)']),
      ...missed.map((m) => `${m}: the nemesis did not bite (a failed run)`),
      `history: ${historyPath}`,
      `timeline: ${join(outDir, 'report.html')}`,
      `reproduce: npm run chaos -- --backend ${o.backend} --workers ${o.workers} --seconds ${o.seconds} --ttl ${o.ttlMs} --hold ${o.holdMs}${o.nemesis === 'replication' ? ` --nemesis replication --min-failbacks ${o.minFailbacks}` : ''}${o.namespaces > 1 ? ` --namespaces ${o.namespaces}` : ''} --seed ${seed}`,
    ].join('\n');
    writeFileSync(join(outDir, 'report.txt'), `${text}\n`);
    // The timeline page (scripts/chaos-report/): re-render later with `npm run chaos:report -- <outDir>`.
    const saved: SavedReport = { report, summary: text.split('\n').slice(0, 3), ok };
    writeFileSync(join(outDir, 'report.json'), `${JSON.stringify(saved, null, 2)}\n`);
    renderChaosReport(outDir);
    return {
      report,
      text,
      ok,
      outDir,
      faults,
      holderFaults,
      partitionedWrites,
      counter,
      crashes,
      ...(summary ? { replication: summary } : {}),
    };
  } finally {
    log('cleaning up');
    for (const h of handles) {
      h.expectExit = true;
      if (h.state !== 'exited') {
        h.child.kill('SIGCONT');
        h.child.kill('SIGKILL');
      }
    }
    await Promise.all(handles.map((h) => withTimeout(h.exited, 10_000, 'worker did not exit').catch(() => {})));
    await Promise.all([...network.values()].flat().map((p) => p.stop()));
    for (const r of redisAdmins.values()) r.disconnect();
    if (topology) await Promise.all([topology.primary.stop(), topology.replica.stop()]);
    else await redis?.stop();
    await cluster?.stop();
    await client.end({ timeout: 5 });
    if (options.keepDatabase) await scratch.keep();
    else await scratch.drop();
    log('done');
  }
}

interface Checked {
  backend: ChaosBackend;
  nemesis: ChaosNemesis;
  namespaces: number;
  minFailbacks: number;
  workers: number;
  seconds: number;
  ttlMs: number;
  holdMs: number;
  databaseUrl: string;
}

function checkOptions(o: ChaosOptions): Checked {
  if (!['redis', 'postgres', 'advisory', 'etcd'].includes(o.backend))
    throw new UsageError('--backend must be redis, postgres, advisory or etcd');
  if (!Number.isInteger(o.workers) || o.workers < 2 || o.workers > 32)
    throw new UsageError('--workers must be an integer in 2 … 32');
  if (!Number.isFinite(o.seconds) || o.seconds < 1 || o.seconds > 7200)
    throw new UsageError('--seconds must be in 1 … 7200');
  const ttlMs = o.ttlMs ?? 1000;
  if (!Number.isInteger(ttlMs) || ttlMs < 100 || ttlMs > 60_000)
    throw new UsageError('--ttl must be an integer in 100 … 60000 ms');
  // etcd counts leases in whole seconds and raises those below 1.5 election timeouts (the run's cluster: 1 s):
  // a shorter TTL would be 2 s in etcd, and pauses and partitions sized on it would end before the lease.
  if (o.backend === 'etcd' && ttlMs < ETCD_MIN_TTL_MS)
    throw new UsageError(`--backend etcd needs --ttl of at least ${ETCD_MIN_TTL_MS} ms`);
  const holdMs = o.holdMs ?? Math.round(ttlMs / 2);
  if (!Number.isInteger(holdMs) || holdMs < 0 || holdMs > 10 * ttlMs)
    throw new UsageError('--hold must be an integer in 0 … 10 × TTL ms');
  const nemesis = o.nemesis ?? 'standard';
  if (nemesis !== 'standard' && nemesis !== 'replication')
    throw new UsageError('--nemesis must be standard or replication');
  if (nemesis === 'replication' && o.backend !== 'redis')
    throw new UsageError('--nemesis replication needs --backend redis');
  const namespaces = o.namespaces ?? 1;
  if (!Number.isInteger(namespaces) || namespaces < 1 || namespaces > 100)
    throw new UsageError('--namespaces must be an integer in 1 … 100');
  if (namespaces > 1 && o.backend !== 'redis') throw new UsageError('--namespaces needs --backend redis');
  const minFailbacks = o.minFailbacks ?? 2;
  if (!Number.isInteger(minFailbacks) || minFailbacks < 0 || minFailbacks > 1000)
    throw new UsageError('--min-failbacks must be an integer in 0 … 1000');
  if (!o.databaseUrl) throw new UsageError('DATABASE_URL is not set');
  const host = new URL(o.databaseUrl).hostname;
  if (!['127.0.0.1', 'localhost', '[::1]', '::1'].includes(host))
    throw new UsageError('the chaos run only targets a loopback Postgres');
  return {
    backend: o.backend,
    nemesis,
    namespaces,
    minFailbacks,
    workers: o.workers,
    seconds: o.seconds,
    ttlMs,
    holdMs,
    databaseUrl: o.databaseUrl,
  };
}

/** The last line of a worker's stderr log that names an error (what crashed it), or a pointer to the log. */
function lastError(path: string): string {
  let lines: string[] = [];
  try {
    lines = readFileSync(path, 'utf8').split('\n');
  } catch {
    // no log
  }
  const error = lines.filter((line) => /^[A-Za-z]*Error\b/.test(line)).at(-1);
  const at = error ? lines[lines.indexOf(error) + 1]?.trim() : undefined;
  return error ? `${error}${at ? ` ${at}` : ''}` : `see ${path}`;
}

/** A full resync starts at once (Redis 7 otherwise waits 5 s for more replicas to join a diskless transfer). */
const PROMPT_SYNC = ['--repl-diskless-sync-delay', '0'];

/** Waits (bounded: 15 s) until a replica's link to its primary is up, i.e. its (full or partial) resync is done. */
async function inSync(replica: Redis): Promise<void> {
  for (let i = 0; i < 150; i++) {
    const info = await replica.info('replication').catch(() => '');
    if (/^master_link_status:up\s*$/m.test(info)) return;
    await sleep(100);
  }
  throw new Error('a replica did not finish its resync within 15 s');
}

/** A bad command line or option. */
export class UsageError extends Error {}

async function withTimeout<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(new Error(`${what} within ${ms} ms`)), ms);
      }),
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** A small seeded PRNG (mulberry32): the nemesis' choices replay from `--seed`. */
/** The shortest lease the run's etcd cluster keeps as asked (whole seconds, at least 1.5 × its 1 s election timeout). */
const ETCD_MIN_TTL_MS = 2_000;

/** The proxy name of an etcd member, as the partition's log names it. */
const etcdProxyName = (member: EtcdMember) => `etcd ${member.name}`;

/**
 * Deletes `namespace`'s etcd source key, then puts a new mark unless a grant put one first; returns the mark
 * that stands and when the old one went (on the history's clock).
 */
async function newEtcdSource(cluster: EtcdCluster, namespace: string): Promise<{ id: string; time: number }> {
  const etcd = new Etcd3({ hosts: cluster.endpoints, dialTimeout: 1_000 });
  try {
    const keys = etcdKeyNames(namespace);
    await etcd.delete().key(keys.source);
    const time = historyTime();
    await etcd.kv.txn(sourceKeyRequest(keys));
    return { id: (await etcd.get(keys.source).string()) ?? '', time };
  } finally {
    etcd.close();
  }
}

function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

async function cli(): Promise<number> {
  const started = Date.now();
  const elapsed = () => `${((Date.now() - started) / 1000).toFixed(1)}s`;
  const { values } = parseArgs({
    options: {
      backend: { type: 'string' },
      workers: { type: 'string', default: '4' },
      seconds: { type: 'string', default: '20' },
      ttl: { type: 'string', default: '1000' },
      hold: { type: 'string' },
      out: { type: 'string' },
      seed: { type: 'string' },
      nemesis: { type: 'string', default: 'standard' },
      namespaces: { type: 'string', default: '1' },
      'min-failbacks': { type: 'string', default: '2' },
      'check-signal': { type: 'boolean', default: false },
      keep: { type: 'boolean', default: false },
      quiet: { type: 'boolean', default: false },
    },
  });
  try {
    const result = await runChaos({
      backend: values.backend as ChaosBackend,
      nemesis: values.nemesis as ChaosNemesis,
      namespaces: Number(values.namespaces),
      minFailbacks: Number(values['min-failbacks']),
      workers: Number(values.workers),
      seconds: Number(values.seconds),
      ttlMs: Number(values.ttl),
      ...(values.hold !== undefined ? { holdMs: Number(values.hold) } : {}),
      ...(values.out !== undefined ? { out: values.out } : {}),
      ...(values.seed !== undefined ? { seed: Number(values.seed) } : {}),
      databaseUrl: process.env.DATABASE_URL ?? '',
      checkSignal: values['check-signal'],
      keepDatabase: values.keep,
      ...(values.quiet ? {} : { log: (line: string) => console.error(`[chaos ${elapsed()}] ${line}`) }),
    });
    console.log(result.text);
    return result.ok ? 0 : 1;
  } catch (err) {
    if (err instanceof UsageError) {
      console.error(`chaos: ${err.message}`);
      console.error(
        'usage: npm run chaos -- --backend redis|postgres|advisory [--nemesis standard|replication] [--namespaces N] [--min-failbacks N] [--workers 4] [--seconds 20] [--ttl 1000] [--hold MS] [--out DIR] [--seed N] [--check-signal] [--keep]',
      );
      return 2;
    }
    throw err;
  }
}

if (process.argv[1] && pathToFileURL(process.argv[1]).href === import.meta.url) {
  process.exitCode = await cli();
}
