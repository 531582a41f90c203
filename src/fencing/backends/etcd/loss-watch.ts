/**
 * The etcd backend's loss watch: a watch on a lease's lock key that aborts
 * the lease's signal when etcd deletes the key or someone else re-creates
 * it (README, "etcd"). A watch is only an early warning: the lease's local
 * deadline and `extend` still decide whether it is held.
 */
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import type { Etcd3, IKeyValue, WatchBuilder, Watcher } from 'etcd3';

/**
 * Restarts of one loss watch (etcd cancelled it) that count against its
 * budget within {@link RESTART_WINDOW_MS}: past it, the next restart waits
 * until the oldest leaves the window. A restarted watch that etcd accepted
 * is forgotten: it proved live, and the next cancellation is a new event (a
 * compaction, then a reconnect), however long the lease is held.
 */
const MAX_RESTARTS = 10;
const RESTART_WINDOW_MS = 30_000;
/** Re-reads of the key after a cancellation that failed (no quorum): retried with backoff, this many at most. */
const MAX_READS = 1_000;
const MIN_PAUSE_MS = 100;
const MAX_PAUSE_MS = 2_000;

/** What a loss watch needs of its backend. */
export interface LossWatchContext {
  /** A new watch (one that requires a leader, where the client allows it: {@link leaderWatches}). */
  watch(): WatchBuilder;
  /** A linearizable read of `key`: its key-value (if any) and the revision the read saw. */
  read(key: string): Promise<{ kv: IKeyValue | undefined; revision: bigint }>;
  /** Background work the backend's `close` waits for (its failures are swallowed). */
  later(work: Promise<unknown>): void;
  /** Whether the backend is closed: nothing is started again then. */
  closed(): boolean;
}

/** One lease's loss watch. */
export interface LossWatch {
  /** Stops it: no event aborts the signal after this, and no restart follows. */
  stop(): void;
  /** After an extension: restarts a watch that stopped retrying at the old local deadline. */
  revive(): void;
}

/**
 * Watches `key` from revision `from` and aborts `lost` when etcd deletes it
 * or re-creates it with another create_revision than `fence`. When etcd
 * cancels the watch (its start revision was compacted while its stream
 * reconnected), the key is read afresh and watched again from that read;
 * a read that fails (no quorum) is retried with backoff until `until()`
 * (the lease's local deadline, a `performance.now()` time), after which
 * the local deadline decides, until {@link LossWatch.revive}. Guarantees
 * no more than what the watch's member tells: a member that is frozen
 * answers nothing and the signal waits for `extend` or the local deadline.
 */
export function startLossWatch(
  ctx: LossWatchContext,
  key: string,
  fence: bigint,
  lost: AbortController,
  until: () => number,
  from = fence + 1n,
): LossWatch {
  let watcher: Watcher | undefined;
  let checking = false;
  const stopped = new AbortController();
  /** performance.now() times of the restarts that still count (see MAX_RESTARTS). */
  const restarts: number[] = [];
  const done = () => stopped.signal.aborted || lost.signal.aborted || ctx.closed();

  function stop(): void {
    stopped.abort();
    const w = watcher;
    watcher = undefined;
    if (w) ctx.later(w.cancel());
  }

  function lose(): void {
    // An event already on its way when the lease was released says nothing of the next holder's.
    if (stopped.signal.aborted) return;
    lost.abort();
    stop();
  }

  /** `restartedAt`: the restart this watch is, forgotten once etcd accepts it. */
  function watchFrom(revision: bigint, restartedAt?: number): void {
    const w = ctx.watch().key(key).startRevision(revision.toString()).watcher();
    w.on('delete', lose);
    w.on('put', (kv) => {
      if (kv.create_revision !== fence.toString()) lose();
    });
    w.once('connected', () => {
      const index = restartedAt === undefined ? -1 : restarts.indexOf(restartedAt);
      if (index >= 0) restarts.splice(index, 1);
    });
    // etcd3 moves a watch's start past the revision of its 'created' answer at once, before etcd has sent the
    // older events it asked for: a stream that breaks in between reconnects past a deletion that is never told.
    // After every reconnect the key is read again.
    let broken = false;
    w.on('disconnected', () => {
      broken = true;
    });
    w.on('connected', () => {
      if (!broken || watcher !== w) return;
      broken = false;
      verify();
    });
    // A broken stream is no verdict on the lease: etcd3 reconnects it. But etcd cancels a watch whose
    // start revision it compacted away, and etcd3 then ends it with 'error'.
    w.on('error', () => {
      if (watcher !== w) return;
      watcher = undefined;
      restart();
    });
    watcher = w;
  }

  const ours = (kv: IKeyValue | undefined) => kv?.create_revision === fence.toString();

  // The key, read (linearizable) after `pause` ms, and read again with backoff while that fails (no quorum, say:
  // the key may be gone or still ours) until the local deadline; undefined once that passed or the watch is done.
  async function readKey(pause: number): Promise<{ kv: IKeyValue | undefined; revision: bigint } | undefined> {
    for (let attempt = 0; attempt < MAX_READS; attempt++) {
      if (pause > 0) await sleep(pause, undefined, { signal: stopped.signal, ref: false }).catch(() => {});
      if (done()) return undefined;
      try {
        return await ctx.read(key);
      } catch {
        if (performance.now() >= until()) return undefined;
        pause = Math.min(MAX_PAUSE_MS, MIN_PAUSE_MS * 2 ** attempt);
      }
    }
    return undefined;
  }

  // After a reconnect: gone, or re-created under another fence, the lease is lost.
  function verify(): void {
    ctx.later(
      readKey(0).then((read) => {
        if (read && !done() && !ours(read.kv)) lose();
      }),
    );
  }

  function restart(): void {
    if (checking || done()) return;
    checking = true;
    const work = recheck().finally(() => {
      checking = false;
    });
    ctx.later(work);
  }

  async function recheck(): Promise<void> {
    const now = performance.now();
    while (restarts.length > 0 && now - (restarts[0] as number) >= RESTART_WINDOW_MS) restarts.shift();
    // Over budget (etcd keeps cancelling at once): wait rather than spin — and rather than give up.
    const read = await readKey(restarts.length >= MAX_RESTARTS ? (restarts[0] as number) + RESTART_WINDOW_MS - now : 0);
    if (!read || done() || watcher) return;
    if (!ours(read.kv)) {
      lose();
      return;
    }
    const at = performance.now();
    restarts.push(at);
    watchFrom(read.revision + 1n, at);
  }

  watchFrom(from);
  return {
    stop,
    revive() {
      if (!watcher) restart();
    },
  };
}

interface WatchInternals {
  readonly pool?: {
    withConnection(service: string, fn: (args: ConnectionArgs) => unknown, gen?: Iterator<unknown>): unknown;
    readonly callOptionsFactory: unknown;
    markFailed(resource: unknown, error: Error): void;
    shuffledHosts?(): Iterator<unknown>;
    readonly hosts?: readonly unknown[];
  };
  readonly watchClient?: object;
  readonly watchManager?: { readonly initialBackoff?: unknown };
  readonly nsApplicator?: unknown;
}

interface ConnectionArgs {
  readonly resource: unknown;
  readonly metadata: GrpcMetadata;
}

interface GrpcMetadata {
  clone(): GrpcMetadata;
  set(key: string, value: string): void;
}

/** How long a member that refused or cancelled a watch for want of a leader is tried last. */
const LEADERLESS_MS = 10_000;

/**
 * Watches whose streams carry etcd's `hasleader: true` metadata (what
 * etcd's Go client calls `WithRequireLeader`): a member refuses them while
 * it has no leader, and cancels them once it has been without one for about
 * three election timeouts — so a watch served by a member cut off from its
 * peers fails instead of staying silent, and is reconnected to another
 * member where the client lists one (a member that said it had no leader is
 * tried last for {@link LEADERLESS_MS}). Built from the client's own watch
 * classes, on a stream of their own, reconnected with the client's watch
 * backoff; a client without those (not etcd3's `Etcd3`) gets its plain
 * `watch()`. Does nothing for a member that is frozen: it cancels nothing.
 */
export function leaderWatches(client: Etcd3): () => WatchBuilder {
  const plain = () => client.watch();
  const internals = client as unknown as WatchInternals;
  const { pool, watchClient, watchManager } = internals;
  const sample = client.watch() as unknown as { constructor: unknown };
  if (!pool || !watchClient || !watchManager?.initialBackoff || typeof sample.constructor !== 'function') return plain;
  const leaderless = new Map<unknown, number>();
  /** The client's order of hosts, those that recently had no leader last (etcd3 takes one per host). */
  function* hosts(): Generator<unknown> {
    const order = pool?.shuffledHosts?.();
    const count = pool?.hosts?.length ?? 0;
    if (!order || count === 0) return;
    const now = performance.now();
    const all = Array.from({ length: count }, () => order.next().value);
    const recent = (h: unknown) => now - (leaderless.get(h) ?? Number.NEGATIVE_INFINITY) < LEADERLESS_MS;
    yield* [...all.filter((h) => !recent(h)), ...all.filter(recent)];
  }
  const leaderPool = {
    withConnection: (service: string, fn: (args: ConnectionArgs) => unknown, gen?: Iterator<unknown>) =>
      pool.withConnection(
        service,
        (args) => {
          const metadata = args.metadata.clone();
          metadata.set('hasleader', 'true');
          const stream = fn({ ...args, metadata }) as { on?(event: 'error', listener: (err: Error) => void): void };
          stream?.on?.('error', (err) => {
            if (/no leader/i.test(String(err?.message))) leaderless.set(args.resource, performance.now());
          });
          return stream;
        },
        gen ?? (pool.shuffledHosts && pool.hosts ? hosts() : undefined),
      ),
    get callOptionsFactory() {
      return pool.callOptionsFactory;
    },
    markFailed: (resource: unknown, error: Error) => pool.markFailed(resource, error),
  };
  type Ctor = new (...args: unknown[]) => unknown;
  const rpc = new (watchClient.constructor as Ctor)(leaderPool);
  const manager = new (watchManager.constructor as Ctor)(rpc, watchManager.initialBackoff);
  const Builder = sample.constructor as new (m: unknown, ns: unknown) => WatchBuilder;
  return () => new Builder(manager, internals.nsApplicator);
}
