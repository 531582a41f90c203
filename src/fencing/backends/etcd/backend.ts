/**
 * The etcd {@link LockBackend}: one etcd lease plus one transaction per
 * grant, the fence being the lock key's `create_revision`. The README's
 * "etcd" section is the manual; `manager.ts` wraps this in a `LockManager`.
 *
 * `etcd3` is an optional peer dependency: this module imports only its
 * *types*, and the caller passes a client.
 */
import type { IKeyValue, IRequestOp, IResponseHeader, ITxnRequest, ITxnResponse, Watcher } from 'etcd3';
import { FenceSourceError, LockServiceError } from '../../../errors.js';
import type { Grant, LockBackend, LockInfo } from '../../backend.js';
import { type Fence, toFence } from '../../fence.js';
import { isTransient, retryingCall, withContext } from './failures.js';
import { keepAliveOnce } from './keep-alive.js';
import { etcdLeaseSeconds } from './keys.js';
import { checkEtcdOptions, type EtcdLockManagerOptions } from './options.js';
import { etcdFenceSource, grantRequest, sourceKeyRequest } from './source.js';

/** What the backend remembers of a lease it granted, by token. */
interface Held {
  readonly token: string;
  readonly name: string;
  readonly fence: Fence;
  leaseId: string;
  seconds: number;
  readonly lost: AbortController;
  watcher: Watcher | undefined;
  /** Watches started again after etcd cancelled one (a compaction): at most {@link MAX_REWATCHES}. */
  rewatches: number;
  /** The extension under way, if any: the next one starts after it (see `extend`). */
  extending: Promise<unknown>;
}

const MAX_REWATCHES = 10;

/**
 * The etcd {@link LockBackend} behind `etcdLockManager`, for composing a
 * manager by hand with `createLockManager`.
 * @throws {InvalidArgumentError} for bad options.
 */
export function etcdLockBackend(options: EtcdLockManagerOptions): LockBackend {
  const { client, keys, timeoutMs } = checkEtcdOptions(options);
  const call = retryingCall(timeoutMs);
  const held = new Map<string, Held>();
  /** Revision at which a grant last found a lock held: waiters watch from the next one, so no release is missed. */
  const seenHeldAt = new Map<string, bigint>();
  /** Background work (lease revocations, watch cancellations) that `close` waits for. */
  const background = new Set<Promise<unknown>>();
  const waiters = new Set<() => void>();
  /** The highest revision any response showed this backend: a fresh grant's fence of its source must be above it. */
  let observed = 0n;
  /** The source of this backend's last grant: the one `observed` is of. */
  let observedSource: string | undefined;
  let closed = false;

  const bytes = (s: string) => Buffer.from(s, 'utf8');

  function observe(header: IResponseHeader | undefined): void {
    if (header?.revision) {
      const revision = BigInt(header.revision);
      if (revision > observed) observed = revision;
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

  /**
   * Aborts `lost` when etcd deletes the lock key or someone else re-creates it after `fence`, watching
   * the key's events from revision `from`.
   */
  function watchForLoss(entry: Held, from = entry.fence + 1n): void {
    const watcher = client
      .watch()
      .key(bytes(keys.lock(entry.name)))
      .startRevision(from.toString())
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
    // A broken watch is no verdict on the lease: the local deadline and extend() still decide. But etcd
    // cancels a watch whose revision it compacted away — one whose stream reconnected resumes from where
    // it started, and a quiet key's revision is soon compacted — and etcd3 then ends it with 'error': the
    // key is read afresh and watched again from that read, or the signal would no longer abort when etcd
    // deletes the key. A read that fails leaves it to the local deadline.
    watcher.on('error', () => {
      if (entry.watcher !== watcher) return;
      entry.watcher = undefined;
      if (entry.rewatches++ < MAX_REWATCHES) later(watchAgain(entry));
    });
    entry.watcher = watcher;
  }

  async function watchAgain(entry: Held): Promise<void> {
    const res = await txn('watch check', { compare: [], success: [rangeOf(keys.lock(entry.name))], failure: [] });
    if (closed || entry.lost.signal.aborted || entry.watcher !== undefined || held.get(entry.token) !== entry) {
      return;
    }
    if (firstKv(res, 0)?.create_revision !== entry.fence.toString()) entry.lost.abort();
    else watchForLoss(entry, BigInt(res.header.revision) + 1n);
  }

  async function extendOnce(entry: Held, name: string, token: string, ttlMs: number): Promise<boolean> {
    if (entry.lost.signal.aborted || held.get(token) !== entry) return false;
    const seconds = etcdLeaseSeconds(ttlMs);
    const leaseId = entry.leaseId;
    if (seconds === entry.seconds) {
      const [renewed, res] = await Promise.all([
        keepAliveOnce(client, leaseId, timeoutMs).catch((err: unknown) => {
          if (isTransient(err)) return undefined;
          throw withContext(err, 'etcd lease keep-alive');
        }),
        txn('extend check', { compare: [], success: [rangeOf(keys.lock(name))], failure: [] }),
      ]);
      const kv = firstKv(res, 0);
      if (renewed === false || kv?.value.toString('utf8') !== token || kv.lease !== leaseId) return false;
      if (renewed) return true;
      // The keep-alive stream failed (its member is down): renew through unary calls instead.
    }
    // etcd cannot change a lease's TTL (nor renew one without a stream): move the keys to a new lease.
    return moveToNewLease(entry, token, seconds);
  }

  const backend: LockBackend = {
    kind: 'etcd',

    async grant(name, token, ttlMs, holder): Promise<Grant | null> {
      const floor = observed;
      const seconds = etcdLeaseSeconds(ttlMs);
      const leaseId = await newLease(seconds);
      let res: ITxnResponse;
      try {
        res = await txn('grant', grantRequest(keys, name, token, leaseId, holder));
        // No source key (a new namespace, or data wiped): put one, then grant again. Twice at most.
        for (let i = 0; i < 2 && !res.succeeded && !firstKv(res, 1); i++) {
          await txn('source', sourceKeyRequest(keys));
          res = await txn('grant', grantRequest(keys, name, token, leaseId, holder));
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
      // Another source than the last grant's (data wiped, or restored with its source key deleted): the
      // revisions seen were of other data, and the floor starts again from this grant.
      const sameSource = observedSource === undefined || observedSource === source;
      if (res.succeeded && fence <= floor && sameSource) {
        revokeLater(granted);
        throw new FenceSourceError(
          `etcd issued revision ${fence} after this process had seen revision ${floor}: the cluster went back (restored from an older snapshot); refusing the fence`,
        );
      }
      if (!sameSource) observed = BigInt(res.header.revision);
      observedSource = source;
      seenHeldAt.delete(name);
      const known = held.get(token);
      if (known && known.fence === fence && !known.lost.signal.aborted)
        return { fence, lost: known.lost.signal, source };
      if (known) cancelLater(known.watcher);
      const entry: Held = {
        token,
        name,
        fence,
        leaseId: granted,
        seconds,
        lost: new AbortController(),
        watcher: undefined,
        rewatches: 0,
        extending: Promise.resolve(),
      };
      held.set(token, entry);
      if (!closed) watchForLoss(entry);
      return { fence, lost: entry.lost.signal, source };
    },

    async extend(name, token, ttlMs) {
      const entry = held.get(token);
      if (!entry || entry.lost.signal.aborted) return false;
      // One at a time per lease: a renewal of the lease the key was on, checked while another extension
      // moved the key to a new lease, passed for the new one — and the lease counted on a TTL etcd did not
      // keep (an attack: 3.0 s kept, 10 s believed).
      const extension = entry.extending.then(() => extendOnce(entry, name, token, ttlMs));
      entry.extending = extension.catch(() => {});
      return extension;
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
