/**
 * One renewal of an etcd lease, for the etcd backend's `extend` (README,
 * "etcd").
 */
import { performance } from 'node:perf_hooks';
import type { Etcd3 } from 'etcd3';
import { LockServiceError } from '../../../errors.js';

/** What a keep-alive's answer tells. */
export interface KeepAliveAnswer {
  /** False if the lease no longer exists (for the member that answered). */
  readonly alive: boolean;
  /** The Raft term of the member that answered: see `extend`'s confirmation in the backend. */
  readonly term: string;
}

/**
 * One keep-alive on a stream of its own, one attempt. Streams bypass the
 * client's retry policy, so a transient failure is left to the caller; the
 * stream's deadline is half of `timeoutMs`, and never past `until` (a
 * `performance.now()` time). The answer is the answering member's view
 * only: a leader that was frozen through an election and resumed renews
 * the lease in its own memory, which the cluster's real leader never sees.
 */
export async function keepAliveOnce(
  client: Etcd3,
  leaseId: string,
  timeoutMs: number,
  until: number,
): Promise<KeepAliveAnswer> {
  const ms = Math.max(1, Math.floor(Math.min(Math.ceil(timeoutMs / 2), until - performance.now())));
  const stream = await client.leaseClient.leaseKeepAlive({ deadline: Date.now() + ms });
  return new Promise<KeepAliveAnswer>((resolve, reject) => {
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
    stream.on('data', (res) =>
      settle(() => resolve({ alive: BigInt(res.TTL || '0') > 0n, term: String(res.header?.raft_term ?? '') })),
    );
    stream.on('error', (err) => settle(() => reject(err)));
    stream.on('end', () =>
      settle(() => reject(new LockServiceError('etcd', 'etcd keep-alive stream ended without an answer'))),
    );
    stream.write({ ID: leaseId });
  });
}
