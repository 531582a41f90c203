/**
 * The etcd {@link LockBackend}: one etcd lease plus one transaction per
 * grant, the fence being the lock key's `create_revision`. The README's
 * "etcd" section is the manual; `manager.ts` wraps this in a `LockManager`.
 *
 * `etcd3` is an optional peer dependency: this module imports only its
 * *types*, and the caller passes a client.
 */
import { performance } from 'node:perf_hooks';
import type { IKeyValue, IRequestOp, ITxnRequest, ITxnResponse } from 'etcd3';
import { FenceSourceError, LockServiceError } from '../../../errors.js';
import type { Grant, LockBackend, LockInfo } from '../../backend.js';
import { type Fence, toFence } from '../../fence.js';
import { isTransient, retryingCall, withContext } from './failures.js';
import { type KeepAliveAnswer, keepAliveOnce } from './keep-alive.js';
import { etcdLeaseSeconds } from './keys.js';
import { type LossWatch, type LossWatchContext, leaderWatches, startLossWatch } from './loss-watch.js';
import { checkEtcdOptions, type EtcdLockManagerOptions } from './options.js';
import { bytes, etcdFenceSource, grantRequest, revisionFloors, sourceKeyRequest } from './source.js';

/** What the backend remembers of a lease it granted, by token. */
interface Held {
  readonly token: string;
  readonly name: string;
  readonly fence: Fence;
  leaseId: string;
  seconds: number;
  readonly lost: AbortController;
  watch: LossWatch | undefined;
  /** The lease's local deadline as this backend counts it (`performance.now()`): see the loss watch. */
  until: number;
  /** The extension under way, if any: the next one starts after it (see `extend`). */
  extending: Promise<unknown>;
}

/**
 * The etcd {@link LockBackend} behind `etcdLockManager`, for composing a
 * manager by hand with `createLockManager`. Every public operation has one
 * deadline, `commandTimeoutMs` from its call, shared by all of its
 * requests and their retries (an extension queued behind another counts
 * its wait too).
 * @throws {InvalidArgumentError} for bad options.
 */
export function etcdLockBackend(options: EtcdLockManagerOptions): LockBackend {
  const { client, keys, timeoutMs } = checkEtcdOptions(options);
  const call = retryingCall(timeoutMs);
  const watch = leaderWatches(client);
  const held = new Map<string, Held>();
  /** Revision at which a grant last found a lock held: waiters watch from the next one, so no release is missed. */
  const seenHeldAt = new Map<string, bigint>();
  /** Background work (lease revocations, watch cancellations) that `close` waits for. */
  const background = new Set<Promise<unknown>>();
  const waiters = new Set<() => void>();
  let closed = false;

  const deadline = () => performance.now() + timeoutMs;

  function later(work: Promise<unknown>): void {
    const tracked = work.catch(() => {}).finally(() => background.delete(tracked));
    background.add(tracked);
  }

  /** Revokes a lease in the background: its keys (if any) go with it; one that already expired is fine. */
  function revokeLater(leaseId: string): void {
    later(call('lease revoke', (o) => client.leaseClient.leaseRevoke({ ID: leaseId }, o)));
  }

  function stopWatch(entry: Held): void {
    entry.watch?.stop();
    entry.watch = undefined;
  }

  async function newLease(seconds: number, until: number): Promise<string> {
    const res = await call('lease grant', (o) => client.leaseClient.leaseGrant({ TTL: seconds, ID: 0 }, o), until);
    if (res.error) throw new LockServiceError('etcd', `etcd lease grant failed: ${res.error}`);
    return res.ID;
  }

  /**
   * Moves the lock (and holder) key of `token` to a new lease of `seconds`:
   * a put over the existing key, so its create_revision — the fence — stays.
   * Unary calls only, so the client's retries and member failover apply.
   */
  async function moveToNewLease(entry: Held, token: string, seconds: number, until: number): Promise<boolean> {
    const lock = keys.lock(entry.name);
    const next = await newLease(seconds, until);
    let res: ITxnResponse;
    try {
      res = await txn(
        'extend',
        {
          compare: [
            { key: bytes(lock), target: 'Value', result: 'Equal', value: bytes(token) },
            { key: bytes(lock), target: 'Lease', result: 'Equal', lease: entry.leaseId },
          ],
          success: [
            { request_put: { key: bytes(lock), value: bytes(token), lease: next } },
            { request_put: { key: bytes(keys.holder(entry.name)), ignore_value: true, lease: next } },
          ],
          failure: [],
        },
        until,
      );
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

  // Only a grant's response raises a source's floor (revisionFloors): it reads the source key in the revision it
  // answers at. Any other response may come from other data — a wiped or replaced cluster — than the last grant's,
  // whose source it would credit with revisions that source never issued (and refuse its correct restore).
  const txn = (what: string, request: ITxnRequest, until?: number): Promise<ITxnResponse> =>
    call(what, (o) => client.kv.txn(request, o), until);

  const rangeOf = (key: string): IRequestOp => ({ request_range: { key: bytes(key) } });
  const firstKv = (res: ITxnResponse, index: number): IKeyValue | undefined =>
    res.responses[index]?.response_range?.kvs?.[0];

  const watchContext: LossWatchContext = {
    watch,
    async read(key) {
      const res = await txn('watch check', { compare: [], success: [rangeOf(key)], failure: [] });
      return { kv: firstKv(res, 0), revision: BigInt(res.header.revision) };
    },
    later,
    closed: () => closed,
  };

  async function extendOnce(entry: Held, token: string, ttlMs: number, until: number): Promise<boolean> {
    if (entry.lost.signal.aborted || held.get(token) !== entry) return false;
    const seconds = etcdLeaseSeconds(ttlMs);
    const leaseId = entry.leaseId;
    if (seconds === entry.seconds) {
      let renewed: KeepAliveAnswer | undefined;
      try {
        renewed = await keepAliveOnce(client, leaseId, timeoutMs, until);
      } catch (err) {
        // The keep-alive stream failed (its member is down): renew through unary calls instead.
        if (!isTransient(err)) throw withContext(err, 'etcd lease keep-alive');
      }
      if (renewed?.alive === false) return false;
      // Read after the renewal was answered: a leader frozen through an election and resumed renews in its
      // own memory only, answering with its old term. A linearizable read answers with the current term:
      // the same term means the renewal was the current leader's, who has led since.
      const res = await txn(
        'extend check',
        { compare: [], success: [rangeOf(keys.lock(entry.name))], failure: [] },
        until,
      );
      const kv = firstKv(res, 0);
      if (kv?.value.toString('utf8') !== token || kv.lease !== leaseId) return false;
      if (renewed && renewed.term !== '' && renewed.term === String(res.header.raft_term)) return true;
      // Unconfirmed (or not renewed at all): a new lease is granted through Raft, which no stale member fakes.
    }
    // etcd cannot change a lease's TTL (nor renew one without a stream): move the keys to a new lease.
    return moveToNewLease(entry, token, seconds, until);
  }

  const backend: LockBackend = {
    kind: 'etcd',

    async grant(name, token, ttlMs, holder): Promise<Grant | null> {
      const started = performance.now();
      const until = started + timeoutMs;
      // What the process had seen before this grant was sent: a later response may show a higher revision.
      const floors = revisionFloors.snapshot();
      const seconds = etcdLeaseSeconds(ttlMs);
      const leaseId = await newLease(seconds, until);
      let res: ITxnResponse;
      try {
        res = await txn('grant', grantRequest(keys, name, token, leaseId, holder), until);
        // No source key (a new namespace, or data wiped): put one, then grant again. Twice at most.
        for (let i = 0; i < 2 && !res.succeeded && !firstKv(res, 1); i++) {
          await txn('source', sourceKeyRequest(keys), until);
          res = await txn('grant', grantRequest(keys, name, token, leaseId, holder), until);
        }
      } catch (err) {
        // Unknown outcome: revoking our lease takes the keys with it if the put did land.
        revokeLater(leaseId);
        throw err;
      }
      const kv = firstKv(res, res.succeeded ? 2 : 0);
      const mark = firstKv(res, res.succeeded ? 3 : 1)?.value.toString('utf8');
      if (!kv || mark === undefined) {
        revokeLater(leaseId);
        const missing = kv ? 'its fence source key' : 'the lock key';
        throw new LockServiceError(
          'etcd',
          `etcd grant of ${JSON.stringify(name)}: the transaction returned no ${missing}`,
        );
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
      const source = etcdFenceSource(res.header, mark);
      if (source === undefined) {
        if (res.succeeded) revokeLater(granted);
        throw new LockServiceError('etcd', `etcd grant of ${JSON.stringify(name)}: the response named no cluster id`);
      }
      // The floor is per source, for the whole process: revisions of other data (a wipe, a restore with
      // its source key deleted) say nothing of this one's, and a source seen before stays refused below
      // what was seen of it, whatever was granted since and by whichever manager.
      const floor = floors.get(source) ?? 0n;
      if (res.succeeded && fence <= floor) {
        revokeLater(granted);
        throw new FenceSourceError(
          `etcd issued revision ${fence} after this process had seen revision ${floor}: the cluster went back (restored from an older snapshot); refusing the fence`,
        );
      }
      revisionFloors.saw(source, BigInt(res.header.revision));
      seenHeldAt.delete(name);
      const known = held.get(token);
      if (known && known.fence === fence && !known.lost.signal.aborted)
        return { fence, lost: known.lost.signal, source };
      if (known) stopWatch(known);
      const entry: Held = {
        token,
        name,
        fence,
        leaseId: granted,
        seconds,
        lost: new AbortController(),
        watch: undefined,
        until: started + ttlMs,
        extending: Promise.resolve(),
      };
      held.set(token, entry);
      if (!closed) {
        const key = keys.lock(name);
        entry.watch = startLossWatch(watchContext, key, fence, entry.lost, () => entry.until);
      }
      return { fence, lost: entry.lost.signal, source };
    },

    async extend(_name, token, ttlMs) {
      const started = performance.now();
      const entry = held.get(token);
      if (!entry || entry.lost.signal.aborted) return false;
      // One at a time per lease: a renewal of the lease the key was on, checked while another extension
      // moved the key to a new lease, passed for the new one — and the lease counted on a TTL etcd did not
      // keep (an attack: 3.0 s kept, 10 s believed).
      const extension = entry.extending.then(async () => {
        const ok = await extendOnce(entry, token, ttlMs, started + timeoutMs);
        if (ok) {
          entry.until = Math.max(entry.until, started + ttlMs);
          entry.watch?.revive();
        }
        return ok;
      });
      entry.extending = extension.catch(() => {});
      return extension;
    },

    async release(name, token) {
      const entry = held.get(token);
      held.delete(token);
      if (entry) stopWatch(entry);
      const lock = keys.lock(name);
      const res = await txn(
        'release',
        {
          compare: [{ key: bytes(lock), target: 'Value', result: 'Equal', value: bytes(token) }],
          success: [
            { request_delete_range: { key: bytes(lock) } },
            { request_delete_range: { key: bytes(keys.holder(name)) } },
          ],
          failure: [],
        },
        deadline(),
      );
      // The lease now holds no key of ours (or expired): free it rather than let it run out.
      if (entry) revokeLater(entry.leaseId);
      return res.succeeded;
    },

    async inspect(name): Promise<LockInfo | null> {
      const until = deadline();
      const res = await txn(
        'inspect',
        { compare: [], success: [rangeOf(keys.lock(name)), rangeOf(keys.holder(name))], failure: [] },
        until,
      );
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
        const ttl = await call(
          'lease time-to-live',
          (o) => client.leaseClient.leaseTimeToLive({ ID: kv.lease, keys: false }, o),
          until,
        );
        remainingMs = Math.max(0, Number(ttl.TTL)) * 1000;
      }
      return { name, holder, fence: toFence(kv.create_revision), acquiredAt: null, remainingMs };
    },

    waitForRelease(name, ms, signal) {
      if (closed || signal?.aborted || ms <= 0) return Promise.resolve();
      const builder = watch()
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
          later(watcher.cancel());
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
      for (const entry of held.values()) stopWatch(entry);
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
