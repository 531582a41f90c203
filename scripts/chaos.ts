/**
 * The chaos run: N worker processes (scripts/chaos-worker.ts) increment one
 * fenced counter under one lock while a nemesis injects real faults; then a
 * Jepsen-style checker reads the history and the audit table.
 *
 * ```sh
 * npm run chaos -- --backend redis|postgres|advisory --workers 4 --seconds 20 [--ttl 1000] [--out DIR] [--seed N]
 * ```
 *
 * Faults, at random intervals (seeded; the timing itself is the machine's):
 * - SIGSTOP of the worker that holds the lock, between its acquire and its
 *   write, for 1.2–3 TTLs, then SIGCONT — it wakes up stale and writes;
 * - kill -9 of a worker (often the holder), restarted under the same label;
 * - redis: FLUSHDB of, or kill -9 and restart of, a redis-server this runner
 *   started itself on a free loopback port (the shared 6379 is never used);
 * - postgres / advisory: `pg_terminate_backend` of the holder's connections
 *   (its pool, and for advisory the session that holds the lock).
 *
 * Each run gets a fresh database (CREATE DATABASE on DATABASE_URL, dropped
 * afterwards unless `--keep`) and a namespace of its own. When the time is
 * up the faults stop, every worker is resumed and asked to stop, a `probe`
 * acquire waits at most one TTL, and `checkHistory` judges. Exit status 1
 * on any anomaly, or if no stale write was rejected (the faults did not
 * bite); 2 on a usage error.
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
import { Redis } from 'ioredis';
import postgres from 'postgres';
import type { Database } from '../src/driver.js';
import { migrate } from '../src/migrate.js';
import { type AuditRow, checkHistory, formatReport, type Report } from '../src/testing/checker.js';
import { historyRecorder, readHistory } from '../src/testing/history.js';
import { openManager } from '../test/support/managers.js';
import { type PrivateRedis, startPrivateRedis } from '../test/support/redis-server.js';
import { renderChaosReport, type SavedReport } from './chaos-report/render.js';
import { CHAOS_DDL, type ChaosWorkerArgs } from './chaos-worker.js';

/** Backends the chaos run knows how to fault. */
export type ChaosBackend = 'redis' | 'postgres' | 'advisory';

/** Options of {@link runChaos}. */
export interface ChaosOptions {
  readonly backend: ChaosBackend;
  readonly workers: number;
  readonly seconds: number;
  /** Lease TTL (default 1000 ms). Pauses last 1.2–3 TTLs. */
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
  /** The counter's final value. */
  readonly counter: number;
  /** Workers that exited without being killed or stopped (restarted, and reported). */
  readonly crashes: readonly string[];
}

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const WORKER = join(ROOT, 'scripts', 'chaos-worker.ts');
const LOCK = 'chaos:counter';
const KEY = 'c';

interface Handle {
  readonly label: string;
  child: ChildProcess;
  /** What the worker last told us: `holding` between `acquired` and `wrote`. */
  state: 'starting' | 'idle' | 'holding' | 'wrote' | 'exited';
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
  const dbName = `palisade_chaos_${randomBytes(5).toString('hex')}`;
  const faults: Record<string, number> = {};
  const fault = (kind: string, detail: string) => {
    faults[kind] = (faults[kind] ?? 0) + 1;
    nemesisRecord({ type: 'ok', op: 'nemesis', reason: `${kind}: ${detail}` });
    historyNemesis({ type: 'ok', op: 'nemesis', reason: `${kind}: ${detail}` });
    log(`nemesis: ${kind} ${detail}`);
  };

  const admin = postgres(o.databaseUrl, { max: 1, onnotice: () => {} });
  await admin.unsafe(`create database ${dbName}`);
  const runUrl = withDatabase(o.databaseUrl, dbName);
  const client = postgres(runUrl, { max: 2, onnotice: () => {} });
  const db = drizzle(client) as unknown as Database;
  let redis: PrivateRedis | undefined;
  const handles: Handle[] = [];
  const crashes: string[] = [];
  // Until the workers are up, a crash is restarted as during the run.
  let deadline = Date.now() + o.seconds * 1000 + 120_000;
  try {
    await migrate(db);
    for (const ddl of CHAOS_DDL) await client.unsafe(ddl);
    await client`insert into chaos_counter (id, n) values (${KEY}, 0)`;
    if (o.backend === 'redis') redis = await startPrivateRedis();
    log(`database ${dbName}, namespace ${namespace}${redis ? `, redis-server on ${redis.url}` : ''}, out ${outDir}`);

    const workerArgs = (label: string): ChaosWorkerArgs => ({
      kind: o.backend,
      namespace,
      databaseUrl: runUrl,
      ...(redis ? { redisUrl: redis.url } : {}),
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
          let m: { event?: string; fence?: string };
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
          } else if (m.event === 'wrote' || m.event === 'skipped') handle.state = 'wrote';
          else if (m.event === 'released') handle.state = 'idle';
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
    const holder = async (within: number): Promise<Handle | undefined> => {
      const until = Date.now() + within;
      while (Date.now() < until) {
        const h = handles.find((x) => x.state === 'holding');
        if (h) return h;
        await sleep(5);
      }
      return undefined;
    };
    const kinds =
      o.backend === 'redis'
        ? ['pause', 'pause', 'kill', 'flush', 'restart']
        : ['pause', 'pause', 'kill', 'terminate', 'terminate'];
    while (Date.now() < deadline) {
      await sleepUntil(between(200, 800));
      if (Date.now() >= deadline) break;
      const kind = kinds[Math.floor(random() * kinds.length)] as string;
      if (kind === 'pause') {
        const h = (await holder(2 * o.ttlMs)) ?? handles[Math.floor(random() * handles.length)];
        if (!h || h.state === 'exited') continue;
        const ms = Math.round(between(1.2, 3) * o.ttlMs);
        fault('pause', `${h.label} (${h.state}${h.state === 'holding' ? ` fence ${h.fence}` : ''}) for ${ms} ms`);
        h.child.kill('SIGSTOP');
        await sleep(ms);
        h.child.kill('SIGCONT');
      } else if (kind === 'kill') {
        const h =
          (random() < 0.5 ? await holder(o.ttlMs) : undefined) ?? handles[Math.floor(random() * handles.length)];
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
        await withTimeout(fresh.ready, 60_000, `${h.label} did not restart`);
      } else if (kind === 'flush' && redis) {
        const r = new Redis(redis.url, { maxRetriesPerRequest: 1, lazyConnect: true });
        r.on('error', () => {});
        try {
          await r.connect();
          await r.flushdb();
          fault('flush', 'FLUSHDB on the private redis-server (locks and fence counter gone)');
        } catch (err) {
          log(`nemesis: FLUSHDB failed: ${String(err)}`);
        } finally {
          r.disconnect();
        }
      } else if (kind === 'restart' && redis) {
        fault('restart', 'kill -9 and restart of the private redis-server (no persistence: every key lost)');
        await redis.restart();
      } else if (kind === 'terminate') {
        const h = await holder(2 * o.ttlMs);
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
    // Nothing wedged: an acquire after the faults, waiting at most one TTL.
    const probeRecord = historyRecorder(historyPath, 'probe');
    const probe = await openManager({
      kind: o.backend,
      namespace,
      databaseUrl: runUrl,
      ...(redis ? { redisUrl: redis.url } : {}),
    });
    try {
      probeRecord({ type: 'invoke', op: 'probe', lock: LOCK });
      try {
        const lease = await probe.manager.acquire(LOCK, { ttlMs: o.ttlMs, waitMs: o.ttlMs, holder: 'probe' });
        probeRecord({ type: 'ok', op: 'probe', lock: LOCK, fence: lease.fence.toString() });
        await lease.release();
      } catch (err) {
        probeRecord({ type: 'fail', op: 'probe', lock: LOCK, reason: String((err as { code?: unknown }).code ?? err) });
      }
    } finally {
      await probe.close();
    }

    log('probe done; checking');
    const audit = (await client`select id, key, fence, process from chaos_audit order by id`) as unknown as AuditRow[];
    const [counterRow] = await client<{ n: number }[]>`select n from chaos_counter where id = ${KEY}`;
    const counter = Number(counterRow?.n ?? -1);
    const report = checkHistory({ history: readHistory(historyPath), audit, counters: { [KEY]: counter } });
    const bit = report.staleWrites.rejected > 0;
    const ok = report.anomalies.length === 0 && bit;
    const faultLine = Object.entries(faults)
      .map(([k, n]) => `${n} ${k}`)
      .join(', ');
    const text = [
      `palisade chaos run: backend ${o.backend}, ${o.workers} workers, ${o.seconds} s of faults, TTL ${o.ttlMs} ms, hold ≤ ${o.holdMs} ms, seed ${seed}`,
      `faults injected: ${faultLine || 'none'}`,
      `counter: ${counter} (audited increments: ${audit.length})`,
      formatReport(report),
      ...(crashes.length === 0
        ? ['worker processes that died on their own: 0']
        : [
            `worker processes that died on their own: ${crashes.length} (not a safety anomaly; a robustness bug):`,
            ...crashes.map((c) => `  - ${c}`),
          ]),
      ...(bit ? [] : ['0 stale writes rejected: the faults did not bite (a failed run)']),
      `history: ${historyPath}`,
      `timeline: ${join(outDir, 'report.html')}`,
      `reproduce: npm run chaos -- --backend ${o.backend} --workers ${o.workers} --seconds ${o.seconds} --ttl ${o.ttlMs} --hold ${o.holdMs} --seed ${seed}`,
    ].join('\n');
    writeFileSync(join(outDir, 'report.txt'), `${text}\n`);
    // The timeline page (scripts/chaos-report/): re-render later with `npm run chaos:report -- <outDir>`.
    const saved: SavedReport = { report, summary: text.split('\n').slice(0, 3), ok };
    writeFileSync(join(outDir, 'report.json'), `${JSON.stringify(saved, null, 2)}\n`);
    renderChaosReport(outDir);
    return { report, text, ok, outDir, faults, counter, crashes };
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
    await redis?.stop();
    await client.end({ timeout: 5 });
    if (!options.keepDatabase) await admin.unsafe(`drop database if exists ${dbName} with (force)`);
    await admin.end({ timeout: 5 });
    log('done');
  }
}

interface Checked {
  backend: ChaosBackend;
  workers: number;
  seconds: number;
  ttlMs: number;
  holdMs: number;
  databaseUrl: string;
}

function checkOptions(o: ChaosOptions): Checked {
  if (!['redis', 'postgres', 'advisory'].includes(o.backend))
    throw new UsageError('--backend must be redis, postgres or advisory');
  if (!Number.isInteger(o.workers) || o.workers < 2 || o.workers > 32)
    throw new UsageError('--workers must be an integer in 2 … 32');
  if (!Number.isFinite(o.seconds) || o.seconds < 1 || o.seconds > 7200)
    throw new UsageError('--seconds must be in 1 … 7200');
  const ttlMs = o.ttlMs ?? 1000;
  if (!Number.isInteger(ttlMs) || ttlMs < 100 || ttlMs > 60_000)
    throw new UsageError('--ttl must be an integer in 100 … 60000 ms');
  const holdMs = o.holdMs ?? Math.round(ttlMs / 2);
  if (!Number.isInteger(holdMs) || holdMs < 0 || holdMs > 10 * ttlMs)
    throw new UsageError('--hold must be an integer in 0 … 10 × TTL ms');
  if (!o.databaseUrl) throw new UsageError('DATABASE_URL is not set');
  const host = new URL(o.databaseUrl).hostname;
  if (!['127.0.0.1', 'localhost', '[::1]', '::1'].includes(host))
    throw new UsageError('the chaos run only targets a loopback Postgres');
  return { backend: o.backend, workers: o.workers, seconds: o.seconds, ttlMs, holdMs, databaseUrl: o.databaseUrl };
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

/** A bad command line or option. */
export class UsageError extends Error {}

function withDatabase(url: string, name: string): string {
  const u = new URL(url);
  u.pathname = `/${name}`;
  return u.toString();
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

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
      'check-signal': { type: 'boolean', default: false },
      keep: { type: 'boolean', default: false },
      quiet: { type: 'boolean', default: false },
    },
  });
  try {
    const result = await runChaos({
      backend: values.backend as ChaosBackend,
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
        'usage: npm run chaos -- --backend redis|postgres|advisory [--workers 4] [--seconds 20] [--ttl 1000] [--hold MS] [--out DIR] [--seed N] [--check-signal] [--keep]',
      );
      return 2;
    }
    throw err;
  }
}

if (process.argv[1] && pathToFileURL(process.argv[1]).href === import.meta.url) {
  process.exitCode = await cli();
}
