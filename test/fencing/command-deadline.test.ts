import { describe, expect, it } from 'vitest';
import { CommandTimeoutError } from '../../src/errors.js';
import { commandDeadline } from '../../src/fencing/backends/redis/command-deadline.js';

describe('the Redis backend command deadline (one timer for all pending commands)', () => {
  it('rejects every command that never settles, passes through those that do, in any order', async () => {
    const bounded = commandDeadline(20);
    const never = () => new Promise<string>(() => {});
    const results = await Promise.allSettled([
      bounded('a', never),
      bounded('b', async () => 'answered'),
      bounded('c', never),
      bounded('d', async () => {
        throw new Error('refused');
      }),
      bounded('e', () => {
        throw new Error('synchronous');
      }),
    ]);
    expect(results.map((r) => r.status)).toEqual(['rejected', 'fulfilled', 'rejected', 'rejected', 'rejected']);
    expect((results[0] as PromiseRejectedResult).reason).toBeInstanceOf(CommandTimeoutError);
    expect((results[2] as PromiseRejectedResult).reason).toBeInstanceOf(CommandTimeoutError);
    expect((results[1] as PromiseFulfilledResult<string>).value).toBe('answered');
    expect((results[3] as PromiseRejectedResult).reason.message).toBe('refused');
    expect((results[4] as PromiseRejectedResult).reason.message).toBe('synchronous');
    // After everything settled, a new command still gets its own deadline.
    await expect(bounded('f', never)).rejects.toBeInstanceOf(CommandTimeoutError);
    await expect(bounded('g', async () => 1)).resolves.toBe(1);
  });
});
