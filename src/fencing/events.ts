import type { Fence } from './fence.js';

/** What a lock manager reports, by event name. */
export interface LockEvents {
  acquired: { name: string; fence: Fence; holder: string | null; waitedMs: number };
  extended: { name: string; fence: Fence; ttlMs: number };
  released: { name: string; fence: Fence; wasHeld: boolean };
  lost: { name: string; fence: Fence; reason: string };
}

/** A tiny typed emitter: no dependency, listeners called synchronously, their errors swallowed. */
export class Emitter<E extends object> {
  readonly #listeners = new Map<keyof E, Set<(event: never) => void>>();

  /** Subscribes; returns the function that unsubscribes. */
  on<K extends keyof E>(type: K, listener: (event: E[K]) => void): () => void {
    let set = this.#listeners.get(type);
    if (!set) {
      set = new Set();
      this.#listeners.set(type, set);
    }
    set.add(listener as (event: never) => void);
    return () => set.delete(listener as (event: never) => void);
  }

  /** Whether anyone listens to `type`: callers skip building an event nobody receives. */
  listens(type: keyof E): boolean {
    return (this.#listeners.get(type)?.size ?? 0) > 0;
  }

  emit<K extends keyof E>(type: K, event: E[K]): void {
    for (const listener of this.#listeners.get(type) ?? []) {
      try {
        (listener as (event: E[K]) => void)(event);
      } catch {
        // A listener's failure must not change what happened to the lock.
      }
    }
  }
}
