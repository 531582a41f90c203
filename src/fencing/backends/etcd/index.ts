/**
 * The etcd lock backend, the `palisade-db/etcd` entry (it needs the optional
 * peer `etcd3`, so the root entry does not load it); the README's "etcd"
 * section is its manual.
 */
export { etcdLockBackend } from './backend.js';
export { etcdLockManager } from './manager.js';
export type { EtcdLockManagerOptions } from './options.js';
