/**
 * The etcd lock backend: leases of etcd v3 (through the npm client `etcd3`),
 * for users who want a replicated, strongly consistent coordinator rather
 * than one Redis or one Postgres.
 *
 * `etcd3` is an optional peer dependency: this module only imports its
 * *types*, and the caller passes a client. Nothing else in palisade loads it.
 *
 * ## Keys
 *
 * With `p = palisade/<namespace>/` (the namespace is `[A-Za-z0-9_.-]`, so it
 * contains no `/`):
 *
 * - `p lock/<name>` — the lock: value = the owner token, attached to an etcd
 *   lease of the grant's own.
 * - `p holder/<name>` — what `inspect` shows (the holder label), same lease.
 *
 * ## Fences
 *
 * The fence is the lock key's `create_revision`: the revision of the etcd
 * cluster at which the key was created. Revisions are global to the cluster
 * and committed through Raft, so every grant's fence is above every fence
 * issued before it — by any lock name, in any namespace, of that cluster —
 * and a leader failover cannot make one go back. No counter of our own is
 * kept, so none can be lost.
 *
 * ## TTLs
 *
 * etcd leases count whole seconds: a `ttlMs` becomes `ceil(ttlMs / 1000)`
 * seconds, and etcd raises a TTL below its minimum (1.5 × the election
 * timeout: 2 s with the default 1 s election timeout). The lease's local
 * deadline (and so `lease.signal`) still uses `ttlMs`: the holder presumes the
 * lease lost no later than the server expires it, never after.
 */
import { performance } from 'node:perf_hooks';
import type { Etcd3, IKeyValue, IRequestOp, IResponseHeader, ITxnRequest, ITxnResponse, Watcher } from 'etcd3';
import { FenceSourceError, InvalidArgumentError, LockServiceError, PalisadeError } from '../../../errors.js';
import type { Grant, LockBackend, LockInfo } from '../../backend.js';
import { type Fence, toFence } from '../../fence.js';
import { createLockManager, type LockManager } from '../../lock-manager.js';
import { checkNamespace } from '../../options.js';
import { withFenceSource } from '../../source.js';
import { etcdFenceSource } from './source.js';

const DEFAULT_COMMAND_TIMEOUT_MS = 10_000;
const MAX_COMMAND_TIMEOUT_MS = 120_000;
const MAX_ATTEMPTS = 12;

/** Options of {@link etcdLockManager}. */
export interface EtcdLockManagerOptions {
  /**
   * The caller's `etcd3` client (`new Etcd3({ hosts: [...] })`), listing
   * every member of the cluster so that calls move on when one is down.
   * palisade never closes it.
   */
  readonly client: Etcd3;
  /** Separates lock sets: 1–100 characters of `[A-Za-z0-9_.-]`. */
  readonly namespace: string;
  /**
   * Upper bound for each operation, retries included (default 10,000 ms:
   * enough to ride out a leader election, which takes about 1–4 s with
   * etcd's default 1 s election timeout). Within it, calls that failed for a
   * transient reason (member down, election under way, timeout) are retried,
   * each attempt bounded to a third of the budget (0.3–2 s), on another
   * member where the client has one: a grant is idempotent per token, so a
   * retried grant never takes the lock twice.
   */
  readonly commandTimeoutMs?: number;
}

/** The etcd keys of one namespace (for operators and tests). */
export interface EtcdKeyNames {
  /** The prefix of every key of the namespace, ending in `/`. */
  readonly prefix: string;
  /** The lock key of a (validated, NFC) lock name; its value is the owner token. */
  lock(name: string): string;
  /** The key holding the holder label of a lock name. */
  holder(name: string): string;
}

/**
 * The keys palisade uses for `namespace` in etcd.
 * @throws {InvalidArgumentError} for a namespace outside `[A-Za-z0-9_.-]{1,100}`.
 */
export function etcdKeyNames(namespace: string): EtcdKeyNames {
  checkNamespace(namespace);
  const prefix = `palisade/${namespace}/`;
  return { prefix, lock: (name) => `${prefix}lock/${name}`, holder: (name) => `${prefix}holder/${name}` };
}

/**
 * The etcd lease TTL, in whole seconds, that a `ttlMs` asks for:
 * `ceil(ttlMs / 1000)`. The server may raise it to its minimum TTL.
 */
export function etcdLeaseSeconds(ttlMs: number): number {
  return Math.max(1, Math.ceil(ttlMs / 1000));
}

/**
 * A lock manager on an etcd v3 cluster. A grant is one etcd lease (TTL
 * `ceil(ttlMs / 1000)` s) plus ONE transaction: `if create_revision(lock) == 0
 * then put(lock, token, lease), put(holder, …, lease) else get(lock)`; the
 * fence is the lock key's `create_revision`. Extending is a lease keep-alive
 * (or, for another TTL, moving the key to a new lease; the fence stays);
 * releasing deletes the keys only if the lock's value is still the token.
 * Waiters watch the lock key and wake on its deletion. A watch on a held
 * lock aborts the lease's signal as soon as etcd deletes the key (the lease
 * expired or was revoked).
 *
 * Guarantees:
 * - fences strictly increase across all grants of the etcd *cluster* (all
 *   lock names, all namespaces), survive the loss of any minority of
 *   members, leader elections and restarts of the whole cluster from its
 *   data directories;
 * - a grant is idempotent per token; release and extend act only for the
 *   token that holds the lock and never touch another holder's keys;
 * - if this process sees a fence at or below a revision it already saw, it
 *   refuses (`FenceSourceError`) instead of issuing it;
 * - no operation waits longer than `commandTimeoutMs`.
 *
 * Does not guarantee:
 * - mutual exclusion: a lease can expire while its holder is paused. Only the
 *   fence, checked by the resource (a fenced repository), refuses the stale
 *   holder's write;
 * - monotonic fences if the cluster is replaced or restored from an older
 *   snapshot (revisions restart lower; restore with `etcdutl snapshot
 *   restore --bump-revision … --mark-compacted`) — only a process that saw
 *   a higher revision notices;
 * - comparability with fences of any other source: a table must take its
 *   fences from one source (one namespace of one backend). A fence from
 *   etcd and one from a Postgres sequence or Redis mean nothing to each
 *   other, and a low-numbered source would lose every row to a high one;
 * - sub-second TTLs, or prompt expiry after a leader change (the new leader
 *   restarts every lease's TTL, so a crashed holder's lock can outlive its
 *   TTL by up to one TTL);
 * - that a release whose reply was lost and that was retried reports
 *   `'released'` (the retry finds the lock gone and says `'lost'`; the lock
 *   is free either way).
 *
 * @throws {InvalidArgumentError} for bad options.
 */
export function etcdLockManager(options: EtcdLockManagerOptions): LockManager {
  const backend = etcdLockBackend(options);
  return createLockManager(
    withFenceSource(backend, checkNamespace(options.namespace), etcdFenceSource(options.client)),
  );
}

/** What the backend remembers of a lease it granted, by token. */
interface Held {
  readonly name: string;
  readonly fence: Fence;
  leaseId: string;
  seconds: number;
  readonly lost: AbortController;
  watcher: Watcher | undefined;
}

interface CallOptions {
  readonly deadline: number;
}

/**
 * The etcd {@link LockBackend} behind {@link etcdLockManager}; exported for
 * tests and for composing a manager by hand with `createLockManager`.
 * @throws {InvalidArgumentError} for bad options.
 */
export function etcdLockBackend(options: EtcdLockManagerOptions): LockBackend {
  if (options === null || typeof options !== 'object') throw new InvalidArgumentError('etcd options are required');
  const { client } = options;
  if (client === null || typeof client !== 'object' || typeof client.watch !== 'function' || !client.kv) {
    throw new InvalidArgumentError('client must be an etcd3 Etcd3 client');
  }
  const keys = etcdKeyNames(options.namespace);
  const timeoutMs = options.commandTimeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS;
  if (!Number.isInteger(timeoutMs) || timeoutMs < 1 || timeoutMs > MAX_COMMAND_TIMEOUT_MS) {
    throw new InvalidArgumentError(`commandTimeoutMs must be an integer in 1 … ${MAX_COMMAND_TIMEOUT_MS}`);
  }

  const attemptMs = Math.min(Math.max(Math.floor(timeoutMs / 3), 300), 2_000);
  const held = new Map<string, Held>();
  /** Revision at which a grant last found a lock held: waiters watch from the next one, so no release is missed. */
  const seenHeldAt = new Map<string, bigint>();
  /** Background work (lease revocations, watch cancellations) that `close` waits for. */
  const background = new Set<Promise<unknown>>();
  const waiters = new Set<() => void>();
  /** The highest revision any response showed this backend: a fresh grant's fence must be above it. */
  let observed = 0n;
  let closed = false;

  const bytes = (s: string) => Buffer.from(s, 'utf8');

  function observe(header: IResponseHeader | undefined): void {
    if (header?.revision) {
      const revision = BigInt(header.revision);
      if (revision > observed) observed = revision;
    }
  }

  /** Runs `fn` until it succeeds, fails for a non-transient reason, or `commandTimeoutMs` is spent. */
  async function call<T>(what: string, fn: (o: CallOptions) => Promise<T>): Promise<T> {
    const until = performance.now() + timeoutMs;
    for (let attempt = 1; ; attempt++) {
      // One attempt gets a share of the budget: a request stuck on a member that lost its leader is
      // abandoned (it may still apply — every operation here tolerates that) and retried elsewhere.
      const left = Math.max(1, Math.floor(Math.min(until - performance.now(), attemptMs)));
      try {
        return await fn({ deadline: Date.now() + left });
      } catch (err) {
        const pause = Math.min(400, 20 * 2 ** attempt) * (0.5 + Math.random() / 2);
        if (!isTransient(err) || attempt >= MAX_ATTEMPTS || performance.now() + pause >= until) {
          throw withContext(err, `etcd ${what}`);
        }
        await sleep(pause);
      }
    }
  }

  function later(work: Promise<unknown>): void {
    const tracked = work.catch(() => {}).finally(() => background.delete(tracked));
    background.add(tracked);
  }

  /** Revokes a lease in the background: its keys (if any) go with it; one that already expired is fine. */
  function revokeLater(leaseId: string): void {
    later(call('lease revoke', (o) => client.leaseClient.leaseRevoke({ ID: leaseId }, o)));
  }

  function cancelLater(watcher: Watcher | undefined): void {
    if (watcher) later(watcher.cancel());
  }

  async function newLease(seconds: number): Promise<string> {
    const res = await call('lease grant', (o) => client.leaseClient.leaseGrant({ TTL: seconds, ID: 0 }, o));
    if (res.error) throw new LockServiceError('etcd', `etcd lease grant failed: ${res.error}`);
    return res.ID;
  }

  /**
   * One keep-alive on a stream of its own, one attempt: true if etcd renewed
   * the lease, false if it no longer exists. Streams bypass the client's
   * retry policy, so a transient failure is left to the caller.
   */
  async function keepAliveOnce(leaseId: string): Promise<boolean> {
    const stream = await client.leaseClient.leaseKeepAlive({ deadline: Date.now() + Math.ceil(timeoutMs / 2) });
    return new Promise<boolean>((resolve, reject) => {
      let settled = false;
      const settle = (fn: () => void) => {
        if (settled) return;
        settled = true;
        fn();
        try {
          stream.end();
        } catch {
          // already closed
        }
      };
      stream.on('data', (res) => settle(() => resolve(BigInt(res.TTL || '0') > 0n)));
      stream.on('error', (err) => settle(() => reject(err)));
      stream.on('end', () => settle(() => reject(new Error('etcd keep-alive stream ended without an answer'))));
      stream.write({ ID: leaseId });
    });
  }

  /**
   * Moves the lock (and holder) key of `token` to a new lease of `seconds`:
   * a put over the existing key, so its create_revision — the fence — stays.
   * Unary calls only, so the client's retries and member failover apply.
   */
  async function moveToNewLease(entry: Held, token: string, seconds: number): Promise<boolean> {
    const lock = keys.lock(entry.name);
    const next = await newLease(seconds);
    let res: ITxnResponse;
    try {
      res = await txn('extend', {
        compare: [
          { key: bytes(lock), target: 'Value', result: 'Equal', value: bytes(token) },
          { key: bytes(lock), target: 'Lease', result: 'Equal', lease: entry.leaseId },
        ],
        success: [
          { request_put: { key: bytes(lock), value: bytes(token), lease: next } },
          { request_put: { key: bytes(keys.holder(entry.name)), ignore_value: true, lease: next } },
        ],
        failure: [],
      });
    } catch (err) {
      revokeLater(next);
      throw err;
    }
    if (!res.succeeded) {
      revokeLater(next);
      return false;
    }
    revokeLater(entry.leaseId);
    entry.leaseId = next;
    entry.seconds = seconds;
    return true;
  }

  function txn(what: string, request: ITxnRequest): Promise<ITxnResponse> {
    return call(what, (o) => client.kv.txn(request, o)).then((res) => {
      observe(res.header);
      return res;
    });
  }

  const rangeOf = (key: string): IRequestOp => ({ request_range: { key: bytes(key) } });
  const firstKv = (res: ITxnResponse, index: number): IKeyValue | undefined =>
    res.responses[index]?.response_range?.kvs?.[0];

  /** Aborts `lost` when etcd deletes the lock key or someone else re-creates it after `fence`. */
  function watchForLoss(entry: Held): void {
    const watcher = client
      .watch()
      .key(bytes(keys.lock(entry.name)))
      .startRevision((entry.fence + 1n).toString())
      .watcher();
    const lose = () => {
      entry.lost.abort();
      if (entry.watcher) {
        cancelLater(entry.watcher);
        entry.watcher = undefined;
      }
    };
    watcher.on('delete', lose);
    watcher.on('put', (kv) => {
      if (kv.create_revision !== entry.fence.toString()) lose();
    });
    // A broken watch is no verdict on the lease: the local deadline and extend() still decide.
    watcher.on('error', () => {});
    entry.watcher = watcher;
  }

  const backend: LockBackend = {
    kind: 'etcd',

    async grant(name, token, ttlMs, holder): Promise<Grant | null> {
      const floor = observed;
      const seconds = etcdLeaseSeconds(ttlMs);
      const lock = keys.lock(name);
      const leaseId = await newLease(seconds);
      let res: ITxnResponse;
      try {
        res = await txn('grant', {
          compare: [{ key: bytes(lock), target: 'Create', result: 'Equal', create_revision: 0 }],
          success: [
            { request_put: { key: bytes(lock), value: bytes(token), lease: leaseId } },
            {
              request_put: { key: bytes(keys.holder(name)), value: bytes(JSON.stringify({ holder })), lease: leaseId },
            },
            rangeOf(lock),
          ],
          failure: [rangeOf(lock)],
        });
      } catch (err) {
        // Unknown outcome: revoking our lease takes the keys with it if the put did land.
        revokeLater(leaseId);
        throw err;
      }
      const kv = firstKv(res, res.succeeded ? 2 : 0);
      if (!kv) {
        revokeLater(leaseId);
        throw new LockServiceError('etcd', `etcd grant of ${JSON.stringify(name)}: the transaction returned no key`);
      }
      let granted = leaseId;
      if (!res.succeeded) {
        if (kv.value.toString('utf8') !== token) {
          revokeLater(leaseId);
          seenHeldAt.set(name, BigInt(res.header.revision));
          return null;
        }
        // An earlier attempt of this very grant won and its reply was lost: same token, same fence.
        granted = kv.lease;
        if (granted !== leaseId) revokeLater(leaseId);
      }
      const fence = toFence(kv.create_revision);
      if (res.succeeded && fence <= floor) {
        revokeLater(granted);
        throw new FenceSourceError(
          `etcd issued revision ${fence} after this process had seen revision ${floor}: the cluster went back (replaced, or restored from an older snapshot); refusing the fence`,
        );
      }
      seenHeldAt.delete(name);
      const known = held.get(token);
      if (known && known.fence === fence && !known.lost.signal.aborted) return { fence, lost: known.lost.signal };
      if (known) cancelLater(known.watcher);
      const entry: Held = { name, fence, leaseId: granted, seconds, lost: new AbortController(), watcher: undefined };
      held.set(token, entry);
      if (!closed) watchForLoss(entry);
      return { fence, lost: entry.lost.signal };
    },

    async extend(name, token, ttlMs) {
      const entry = held.get(token);
      if (!entry || entry.lost.signal.aborted) return false;
      const seconds = etcdLeaseSeconds(ttlMs);
      if (seconds === entry.seconds) {
        const [renewed, res] = await Promise.all([
          keepAliveOnce(entry.leaseId).catch((err: unknown) => {
            if (isTransient(err)) return undefined;
            throw withContext(err, 'etcd lease keep-alive');
          }),
          txn('extend check', { compare: [], success: [rangeOf(keys.lock(name))], failure: [] }),
        ]);
        const kv = firstKv(res, 0);
        if (renewed === false || kv?.value.toString('utf8') !== token || kv.lease !== entry.leaseId) return false;
        if (renewed) return true;
        // The keep-alive stream failed (its member is down): renew through unary calls instead.
      }
      // etcd cannot change a lease's TTL (nor renew one without a stream): move the keys to a new lease.
      return moveToNewLease(entry, token, seconds);
    },

    async release(name, token) {
      const entry = held.get(token);
      held.delete(token);
      if (entry) {
        cancelLater(entry.watcher);
        entry.watcher = undefined;
      }
      const lock = keys.lock(name);
      const res = await txn('release', {
        compare: [{ key: bytes(lock), target: 'Value', result: 'Equal', value: bytes(token) }],
        success: [
          { request_delete_range: { key: bytes(lock) } },
          { request_delete_range: { key: bytes(keys.holder(name)) } },
        ],
        failure: [],
      });
      // The lease now holds no key of ours (or expired): free it rather than let it run out.
      if (entry) revokeLater(entry.leaseId);
      return res.succeeded;
    },

    async inspect(name): Promise<LockInfo | null> {
      const res = await txn('inspect', {
        compare: [],
        success: [rangeOf(keys.lock(name)), rangeOf(keys.holder(name))],
        failure: [],
      });
      const kv = firstKv(res, 0);
      if (!kv) return null;
      const label = firstKv(res, 1);
      let holder: string | null = null;
      if (label && label.lease === kv.lease) {
        try {
          const parsed = JSON.parse(label.value.toString('utf8')) as { holder?: unknown };
          if (typeof parsed.holder === 'string') holder = parsed.holder;
        } catch {
          // someone wrote the key by hand: no label
        }
      }
      let remainingMs: number | null = null;
      if (kv.lease !== '0') {
        const ttl = await call('lease time-to-live', (o) =>
          client.leaseClient.leaseTimeToLive({ ID: kv.lease, keys: false }, o),
        );
        remainingMs = Math.max(0, Number(ttl.TTL)) * 1000;
      }
      return { name, holder, fence: toFence(kv.create_revision), acquiredAt: null, remainingMs };
    },

    waitForRelease(name, ms, signal) {
      if (closed || signal?.aborted || ms <= 0) return Promise.resolve();
      const builder = client
        .watch()
        .key(bytes(keys.lock(name)))
        .only('delete');
      const from = seenHeldAt.get(name);
      seenHeldAt.delete(name); // every wait follows a grant that found the lock held and set it again
      if (from !== undefined) builder.startRevision((from + 1n).toString());
      const watcher = builder.watcher();
      return new Promise<void>((resolve) => {
        const done = () => {
          clearTimeout(timer);
          signal?.removeEventListener('abort', done);
          waiters.delete(done);
          cancelLater(watcher);
          resolve();
        };
        const timer = setTimeout(done, ms);
        timer.unref();
        watcher.on('delete', done);
        // A failed watch (e.g. its start revision was compacted) just leaves the timeout.
        watcher.on('error', () => {});
        signal?.addEventListener('abort', done, { once: true });
        waiters.add(done);
      });
    },

    async close() {
      closed = true;
      for (const wake of [...waiters]) wake();
      for (const entry of held.values()) {
        cancelLater(entry.watcher);
        entry.watcher = undefined;
      }
      held.clear();
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([
        Promise.allSettled([...background]),
        new Promise((resolve) => {
          timer = setTimeout(resolve, timeoutMs);
          timer.unref();
        }),
      ]);
      clearTimeout(timer);
    },
  };
  return backend;
}

const TRANSIENT_NAMES = new Set([
  'GRPCUnavailableError',
  'GRPCDeadlineExceededError',
  'GRPCCancelledError',
  'GRPCInternalError',
  'GRPCAbortedError',
  'GRPCResourceExhastedError',
  'BrokenCircuitError',
]);
const TRANSIENT_MESSAGE =
  /UNAVAILABLE|DEADLINE_EXCEEDED|leader changed|no leader|request timed out|timed out|too many requests|not capable|circuit|ECONNREFUSED|ECONNRESET|keep-alive stream ended/i;

/** Member down, election under way, timeout: another attempt (maybe on another member) may succeed. */
function isTransient(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  return TRANSIENT_NAMES.has(err.constructor.name) || TRANSIENT_MESSAGE.test(err.message);
}

/**
 * etcd3's (and gRPC's) errors become a {@link LockServiceError} that says
 * which operation failed and keeps the original as its cause; palisade's
 * own errors pass through.
 */
function withContext(err: unknown, what: string): unknown {
  if (err instanceof PalisadeError) return err;
  const message = err instanceof Error ? err.message : String(err);
  const hint = isTransient(err) ? ' (the cluster did not answer in time: members down, or an election under way)' : '';
  return new LockServiceError('etcd', `${what} failed${hint}: ${message}`, err);
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
