/**
 * Which failures of a transaction palisade began came once its COMMIT was
 * on its way: where such a failure says the session ended, whether the
 * transaction committed is unknown (`DatabaseError.outcomeUnknown`; README,
 * "When the connection closes inside a transaction"); and so for a write
 * sent on its own.
 */
import { DatabaseError } from './errors.js';
import { sessionEnded } from './server-error.js';

const atCommit = new WeakSet<object>();

/** @internal Notes that `err` failed the transaction once its COMMIT was on its way. */
export function afterCommitSent(err: unknown): void {
  if (typeof err === 'object' && err !== null) atCommit.add(err);
}

/** @internal Whether {@link afterCommitSent} noted `err`. */
export const failedAtCommit = (err: unknown): boolean => typeof err === 'object' && err !== null && atCommit.has(err);

/**
 * @internal For a write sent on its own, outside a transaction: a failure that no answer of the server's explains
 * — its session ended, or the client gave up waiting (node-postgres's `query_timeout`, a socket error) — leaves the
 * write's outcome unknown, as at a transaction's COMMIT: the statement may still be running, and commit. Thrown
 * with `outcomeUnknown` then; any other failure as it is.
 */
export function unansweredWrite(err: unknown): never {
  // node-postgres refuses a statement on a client it knows closed before sending it: nothing went out.
  const unsent = err instanceof Error && NOT_SENT.test(err.message);
  if (
    err instanceof DatabaseError &&
    !unsent &&
    !err.outcomeUnknown &&
    (err.sqlState === undefined || sessionEnded(err))
  ) {
    throw new DatabaseError(err.sqlState, err.cause, true);
  }
  throw err;
}

const NOT_SENT = /is not queryable/;
