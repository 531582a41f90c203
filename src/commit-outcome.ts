/**
 * Which failures of a transaction palisade began came once its COMMIT was
 * on its way: where such a failure says the session ended, whether the
 * transaction committed is unknown (`DatabaseError.outcomeUnknown`; README,
 * "When the connection closes inside a transaction").
 */

const atCommit = new WeakSet<object>();

/** @internal Notes that `err` failed the transaction once its COMMIT was on its way. */
export function afterCommitSent(err: unknown): void {
  if (typeof err === 'object' && err !== null) atCommit.add(err);
}

/** @internal Whether {@link afterCommitSent} noted `err`. */
export const failedAtCommit = (err: unknown): boolean => typeof err === 'object' && err !== null && atCommit.has(err);
