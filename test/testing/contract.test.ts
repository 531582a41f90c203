/**
 * The contract suite can fail: each check passes on a backend that keeps the
 * contract (in one process) and fails on one with the flaw it is there to
 * catch. The built-in backends run the suite in test/fencing/contract.test.ts
 * and test-slow/etcd.test.ts.
 */
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import type { ContractSubject, LockBackendContract } from '../../src/testing/contract.js';
import {
  checkBadInputRefused,
  checkIdempotentGrant,
  checkIncreasingFences,
  checkInspect,
  checkLateRelease,
  checkReleaseWakesWaiter,
  checkTokenChecked,
} from '../../src/testing/contract-checks.js';
import { checkLockIdentityCarried } from '../../src/testing/contract-identity.js';
import { checkNoOverlapAcrossProcesses } from '../../src/testing/contract-process.js';
import { type MemoryFlaws, memoryBackend } from './memory-backend.js';

const TTL = 10_000;
// A failed assertion of the check, not a crash of the harness (a worker that could not start, say).
const ASSERTION = { name: 'AssertionError' };

function subject(flaws: MemoryFlaws = {}): ContractSubject {
  const backend = memoryBackend(flaws);
  return { backend, processOptions: {}, dispose: () => backend.close() };
}

describe('describeLockBackend checks', () => {
  it('pass on a backend that keeps the contract', async () => {
    await checkIdempotentGrant(subject(), expect, TTL);
    await checkTokenChecked(subject(), expect, TTL);
    await checkLateRelease(subject(), expect, TTL);
    await checkIncreasingFences(subject(), expect, TTL);
    await checkReleaseWakesWaiter(subject(), expect, TTL);
    await checkBadInputRefused(subject(), expect);
    await checkInspect(subject(), expect, TTL);
    await checkLockIdentityCarried(subject(), expect, TTL);
    await checkLockIdentityCarried(subject({ namespace: 'ns' }), expect, TTL);
  });

  it('catch a backend with a namespace whose grants name no source, or a different one each', async () => {
    for (const flaw of [{ sourceMissing: true }, { sourceVaries: true }]) {
      await expect(checkLockIdentityCarried(subject({ namespace: 'ns', ...flaw }), expect, TTL)).rejects.toMatchObject(
        ASSERTION,
      );
    }
  });

  it('catch a re-sent grant that draws a new fence', async () => {
    await expect(checkIdempotentGrant(subject({ resendDrawsFence: true }), expect, TTL)).rejects.toMatchObject(
      ASSERTION,
    );
  });

  it('catch a release that does not check the token', async () => {
    await expect(checkTokenChecked(subject({ releaseIgnoresToken: true }), expect, TTL)).rejects.toMatchObject(
      ASSERTION,
    );
  });

  it('catch a late release that frees the next holder', async () => {
    await expect(checkLateRelease(subject({ lateReleaseFreesNext: true }), expect, TTL)).rejects.toMatchObject(
      ASSERTION,
    );
  });

  it('catch fences that do not increase', async () => {
    await expect(checkIncreasingFences(subject({ fenceNeverMoves: true }), expect, TTL)).rejects.toMatchObject(
      ASSERTION,
    );
  });

  it('catch a backend whose locks are not shared across processes', async () => {
    const contract: LockBackendContract = {
      processModule: fileURLToPath(new URL('./memory-backend.ts', import.meta.url)),
      open: async () => subject(),
    };
    await expect(checkNoOverlapAcrossProcesses(subject(), expect, contract, TTL)).rejects.toMatchObject(ASSERTION);
  }, 120_000);
});
