/**
 * One renewal of an etcd lease, for the etcd backend's `extend` (README,
 * "etcd").
 */
import type { Etcd3 } from 'etcd3';
import { LockServiceError } from '../../../errors.js';

/**
 * One keep-alive on a stream of its own, one attempt: true if etcd renewed
 * the lease, false if it no longer exists. Streams bypass the client's
 * retry policy, so a transient failure is left to the caller; the stream's
 * deadline is half of `timeoutMs`.
 */
export async function keepAliveOnce(client: Etcd3, leaseId: string, timeoutMs: number): Promise<boolean> {
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
    stream.on('end', () =>
      settle(() => reject(new LockServiceError('etcd', 'etcd keep-alive stream ended without an answer'))),
    );
    stream.write({ ID: leaseId });
  });
}
