/**
 * A lock backend in one process's memory, for testing the contract suite
 * itself: correct within a process, and with switchable flaws each of which
 * one contract check must catch. As a process module (`openBackend`) it is
 * deliberately wrong: every process gets a store of its own, so locks are
 * not shared across processes.
 */
import type { Grant, LockBackend, LockInfo } from '../../src/fencing/backend.js';
import { toFence } from '../../src/fencing/fence.js';

export interface MemoryFlaws {
  /** A re-sent grant draws a new fence instead of returning the held one. */
  readonly resendDrawsFence?: boolean;
  /** `release` frees the lock whatever the token. */
  readonly releaseIgnoresToken?: boolean;
  /** Every grant carries fence 1. */
  readonly fenceNeverMoves?: boolean;
  /** `release` of an expired lease frees whoever holds the lock now. */
  readonly lateReleaseFreesNext?: boolean;
  /** Not a flaw: declare this namespace, and give every grant the source `memory:<store>`. */
  readonly namespace?: string;
  /** With `namespace`: grants carry no source. */
  readonly sourceMissing?: boolean;
  /** With `namespace`: every grant names a source of its own. */
  readonly sourceVaries?: boolean;
}

interface Held {
  token: string;
  fence: bigint;
  holder: string | null;
  expiresAt: number;
  acquiredAt: Date;
}

/** A fresh in-memory backend with the given flaws (none: it keeps the contract in one process). */
export function memoryBackend(flaws: MemoryFlaws = {}): LockBackend {
  const locks = new Map<string, Held>();
  const wakers = new Map<string, Set<() => void>>();
  let counter = 0n;
  const store = Math.random().toString(36).slice(2);
  const withSource = (grant: Grant): Grant => {
    if (flaws.namespace === undefined || flaws.sourceMissing) return grant;
    return { ...grant, source: flaws.sourceVaries ? `memory:${store}:${grant.fence}` : `memory:${store}` };
  };
  const live = (name: string) => {
    const held = locks.get(name);
    return held && held.expiresAt > Date.now() ? held : undefined;
  };
  const wake = (name: string) => {
    for (const w of wakers.get(name) ?? []) w();
  };
  return {
    kind: 'memory',
    ...(flaws.namespace === undefined ? {} : { namespace: flaws.namespace }),
    async grant(name, token, ttlMs, holder): Promise<Grant | null> {
      const held = live(name);
      if (held && held.token !== token) return null;
      if (held && !flaws.resendDrawsFence) return withSource({ fence: toFence(held.fence) });
      counter++;
      const fence = flaws.fenceNeverMoves ? 1n : counter;
      locks.set(name, { token, fence, holder, expiresAt: Date.now() + ttlMs, acquiredAt: new Date() });
      return withSource({ fence: toFence(fence) });
    },
    async extend(name, token, ttlMs) {
      const held = live(name);
      if (!held || held.token !== token) return false;
      held.expiresAt = Date.now() + ttlMs;
      return true;
    },
    async release(name, token) {
      const held = flaws.lateReleaseFreesNext ? locks.get(name) : live(name);
      if (!held || (held.token !== token && !flaws.releaseIgnoresToken && !flaws.lateReleaseFreesNext)) return false;
      locks.delete(name);
      wake(name);
      return held.token === token || Boolean(flaws.releaseIgnoresToken);
    },
    async inspect(name): Promise<LockInfo | null> {
      const held = live(name);
      if (!held) return null;
      const { holder, acquiredAt } = held;
      return { name, holder, fence: toFence(held.fence), acquiredAt, remainingMs: held.expiresAt - Date.now() };
    },
    waitForRelease(name, ms, signal) {
      return new Promise<void>((resolve) => {
        const set = wakers.get(name) ?? new Set();
        wakers.set(name, set);
        const done = () => {
          clearTimeout(timer);
          set.delete(done);
          signal?.removeEventListener('abort', done);
          resolve();
        };
        const timer = setTimeout(done, ms);
        set.add(done);
        signal?.addEventListener('abort', done);
      });
    },
    async close() {
      locks.clear();
    },
  };
}

/** The process module: a store of each process's own (wrong on purpose; see the module header). */
export async function openBackend(): Promise<{ backend: LockBackend; close(): Promise<void> }> {
  const backend = memoryBackend();
  return { backend, close: () => backend.close() };
}
