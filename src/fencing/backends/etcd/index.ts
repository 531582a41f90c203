/**
 * The etcd lock backend, the `palisade-db/etcd` entry (it needs the optional
 * peer `etcd3`, so the root entry does not load it); the README's "etcd"
 * section is its manual.
 */
export { type EtcdLockManagerOptions, etcdLockBackend, etcdLockManager } from './backend.js';
