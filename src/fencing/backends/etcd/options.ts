/** The options of the etcd backend and their checks; the README's "etcd" section is the manual. */
import type { Etcd3 } from 'etcd3';
import { InvalidArgumentError } from '../../../errors.js';
import type { ClaimRegistersOption } from '../../eager-claim.js';
import { type EtcdKeyNames, etcdKeyNames } from './keys.js';

const DEFAULT_COMMAND_TIMEOUT_MS = 10_000;
const MAX_COMMAND_TIMEOUT_MS = 120_000;

/** Options of `etcdLockManager` and `etcdLockBackend`. */
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
  /**
   * The eager claim at acquire (README, "When each backend claims"): each
   * grant claims its lock's register in `db`, the fenced tables' database,
   * before `acquire` resolves, so a stale holder is refused on every row
   * before the new holder writes. One statement on `db` per grant. A grant
   * that finds a higher fence there is released and the acquire fails with
   * `FenceSourceError`.
   */
  readonly claimRegisters?: ClaimRegistersOption;
}

/** Options after their checks. */
export interface CheckedEtcdOptions {
  readonly client: Etcd3;
  readonly keys: EtcdKeyNames;
  /** The bound of one operation, retries included. */
  readonly timeoutMs: number;
}

/**
 * Checks the options before any call reaches etcd.
 * @throws {InvalidArgumentError} for a missing client, a bad namespace or a bad `commandTimeoutMs`.
 */
export function checkEtcdOptions(options: EtcdLockManagerOptions): CheckedEtcdOptions {
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
  return { client, keys, timeoutMs };
}
