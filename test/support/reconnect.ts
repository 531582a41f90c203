/**
 * A statement after a connection was killed: postgres.js hands the killed
 * session's error to the first statement after it reconnects, and a pool may
 * lend a session whose termination it has not read yet (README, "When the
 * connection closes inside a transaction"). Either way the next try goes
 * through on a new session.
 */
import { sessionEnded } from '../../src/server-error.js';

/** `call()`, tried again (at most `tries` times in all) while it rejects with the error of a session that ended. */
export async function retryEndedSession<T>(call: () => Promise<T>, tries = 3, onRetry?: () => void): Promise<T> {
  for (let i = 1; ; i++) {
    try {
      return await call();
    } catch (err) {
      if (i >= tries || !sessionEnded(err)) throw err;
      onRetry?.();
    }
  }
}
