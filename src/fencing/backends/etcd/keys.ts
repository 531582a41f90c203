/**
 * Where the etcd backend keeps a namespace's locks. With `p =
 * palisade/<namespace>/` (the namespace rule allows no `/`): `p lock/<name>`
 * holds the owner token and `p holder/<name>` the holder label, both
 * attached to the grant's own etcd lease, so they expire together; `p
 * source` holds the random mark that names the namespace's fence source
 * (./source.ts), with no lease.
 */
import { checkNamespace } from '../../options.js';

/** The etcd keys of one namespace (for operators and tests). */
export interface EtcdKeyNames {
  /** The prefix of every key of the namespace, ending in `/`. */
  readonly prefix: string;
  /** The lock key of a (validated, NFC) lock name; its value is the owner token. */
  lock(name: string): string;
  /** The key holding the holder label of a lock name. */
  holder(name: string): string;
  /** The key whose value names the fence source (put once, by the first grant that finds it missing). */
  readonly source: string;
}

/**
 * The keys palisade uses for `namespace` in etcd.
 * @throws {InvalidArgumentError} for a namespace outside `[A-Za-z0-9_.-]{1,100}`.
 */
export function etcdKeyNames(namespace: string): EtcdKeyNames {
  checkNamespace(namespace);
  const prefix = `palisade/${namespace}/`;
  return {
    prefix,
    lock: (name) => `${prefix}lock/${name}`,
    holder: (name) => `${prefix}holder/${name}`,
    source: `${prefix}source`,
  };
}

/**
 * The etcd lease TTL, in whole seconds, that a `ttlMs` asks for:
 * `ceil(ttlMs / 1000)`. The server may raise it to its minimum TTL.
 */
export function etcdLeaseSeconds(ttlMs: number): number {
  return Math.max(1, Math.ceil(ttlMs / 1000));
}
