/**
 * withinMs, the client-side bound of the Postgres backends' calls: it
 * settles as the work does when the work is on time; at the deadline it
 * rejects with CommandTimeoutError and tells the work it was abandoned;
 * what the work settles with afterwards goes to `onLate` — its value, or
 * undefined for a failure (where a late grant is given back:
 * test/fencing/postgres-frozen.test.ts) — and a late error to nobody else.
 */
import { describe, expect, it } from 'vitest';
import { CommandTimeoutError } from '../../src/errors.js';
import { withinMs } from '../../src/fencing/call-deadline.js';

function deferred<T>() {
  let resolve!: (value: T) => void;
  let reject!: (err: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

describe('withinMs', () => {
  it('settles as the work does when it is on time', async () => {
    await expect(withinMs('ok', 60_000, async () => 7)).resolves.toBe(7);
    const boom = new Error('boom');
    await expect(withinMs('err', 60_000, async () => Promise.reject(boom))).rejects.toBe(boom);
    await expect(
      withinMs('sync throw', 60_000, () => {
        throw boom;
      }),
    ).rejects.toBe(boom);
  });

  it('at the deadline: CommandTimeoutError, and the work is told it was abandoned', async () => {
    const work = deferred<string>();
    let signal: AbortSignal | undefined;
    const call = withinMs('Postgres lease grant', 5, (abandoned) => {
      signal = abandoned;
      return work.promise;
    });
    const err = await call.catch((e: unknown) => e);
    expect(err).toBeInstanceOf(CommandTimeoutError);
    expect((err as Error).message).toBe('Postgres lease grant did not answer within 5 ms (it may still run)');
    expect(signal?.aborted).toBe(true);
    work.resolve('granted after all');
    await work.promise;
    await expect(call).rejects.toBe(err); // settled once, for good
  });

  it('a value after the deadline goes to onLate, once, and the call stays rejected', async () => {
    const work = deferred<string>();
    const late: (string | undefined)[] = [];
    const call = withinMs(
      'x',
      5,
      () => work.promise,
      (value) => late.push(value),
    );
    await expect(call).rejects.toBeInstanceOf(CommandTimeoutError);
    expect(late).toEqual([]);
    work.resolve('granted after all');
    await work.promise;
    expect(late).toEqual(['granted after all']);
    await expect(call).rejects.toBeInstanceOf(CommandTimeoutError);
    // On time, onLate is not called.
    await expect(
      withinMs(
        'y',
        60_000,
        async () => 'on time',
        (value) => late.push(value),
      ),
    ).resolves.toBe('on time');
    expect(late).toEqual(['granted after all']);
  });

  it('an error after the deadline reaches nobody (no unhandled rejection); onLate hears of it as undefined', async () => {
    const work = deferred<string>();
    const late: (string | undefined)[] = [];
    const call = withinMs(
      'x',
      5,
      () => work.promise,
      (value) => late.push(value),
    );
    await expect(call).rejects.toBeInstanceOf(CommandTimeoutError);
    work.reject(new Error('connection closed')); // a grant may have committed before its reply was lost
    await work.promise.catch(() => {});
    await expect(call).rejects.toBeInstanceOf(CommandTimeoutError);
    expect(late).toEqual([undefined]);
  });
});
