/**
 * Calls that overlap on one transaction (README, "Fenced transactions"). A
 * transaction is one session: a statement one call sends while another
 * call's savepoint is open runs inside that savepoint, and a rollback to it
 * (its function threw, its write was refused) undoes the statement after
 * its call reported it applied. So while one of palisade's savepoints is
 * open, palisade sends nothing through the object it was opened through;
 * calls made inside the savepoint's function resolve to the savepoint's own
 * object (repo/joined.ts). Statements the caller sends itself are not seen.
 */
import type { Database } from './driver.js';
import { InvalidArgumentError } from './errors.js';

// The transactions on which one of palisade's savepoints is open, by the object it was opened through.
const savepointOpen = new WeakSet<Database>();
// The transactions and savepoints palisade opened that have ended: a call started inside one's function and
// left running would send its statements into whatever the session runs next (another call's savepoint, the
// outer transaction, a pool client lent to someone else). A savepoint whose parent ended has ended too.
const ended = new WeakSet<Database>();
// Each savepoint palisade opened, to the object it was opened through.
const parentOf = new WeakMap<Database, Database>();

/**
 * @internal Refuses a statement of palisade's sent through `db` while one of palisade's savepoints is open
 * on it, or after the transaction or savepoint palisade opened as `db` ended.
 * @throws {InvalidArgumentError}
 */
export function assertMaySend(db: Database): void {
  if (savepointOpen.has(db)) {
    throw new InvalidArgumentError(
      "a call on a transaction overlapped another call's savepoint on it (a modify, a lock-scoped write, a nested fencedTransaction): run calls on one transaction one after another",
    );
  }
  if (hasEnded(db)) {
    throw new InvalidArgumentError(
      'a call was made on a transaction palisade opened after it ended (started inside its function, not awaited there)',
    );
  }
}

/**
 * @internal The savepoints and the transaction palisade opened `tx` in, innermost first (empty for a
 * transaction of its own, or one palisade did not open).
 */
export function enclosing(tx: Database): Database[] {
  const around: Database[] = [];
  for (let at = parentOf.get(tx); at !== undefined; at = parentOf.get(at)) around.push(at);
  return around;
}

// Whether `db`, or a transaction or savepoint it was opened in, is one palisade opened that has ended.
function hasEnded(db: Database | undefined): boolean {
  for (let at = db; at !== undefined; at = parentOf.get(at)) if (ended.has(at)) return true;
  return false;
}

/**
 * @internal Notes that palisade opens a transaction on `db` (a savepoint when `savepoint`), refused where
 * {@link assertMaySend} refuses a statement. Then, with the transaction object the driver gives:
 * `opened(tx)`; `ended(tx)` as soon as palisade's function in it settled (before the driver's release,
 * commit or rollback, which a statement left running must neither precede nor follow); `closed()` once the
 * driver is done with it.
 * `orphaned()` tells, as the function settles, that the transaction the savepoint was opened in ended
 * first: the savepoint went with its parent's rollback (a savepoint still open when its parent's function
 * settles rolls the parent back, see `ended`), so its driver must send nothing more for it — a `RELEASE`
 * or `ROLLBACK TO` would fail, and abort whatever the session runs by then (the caller's transaction going
 * on past a refused call) or run in it.
 * @throws {InvalidArgumentError} from `ended` when the function returned (`failed`: it threw) while a
 * savepoint opened inside `tx` is still open: a call left running past it, whose writes must be committed
 * neither with the transaction nor after it — it rolls back.
 */
export function opening(
  db: Database,
  savepoint: boolean,
): { opened(tx: Database): void; orphaned(): boolean; ended(tx: Database, failed: boolean): void; closed(): void } {
  assertMaySend(db);
  if (savepoint) savepointOpen.add(db);
  return {
    opened: (tx) => {
      if (savepoint) parentOf.set(tx, db);
    },
    orphaned: () => savepoint && hasEnded(db),
    ended: (tx, failed) => {
      ended.add(tx);
      // A failed function rolls it back anyway: its own error is the news.
      if (!failed && savepointOpen.has(tx)) {
        throw new InvalidArgumentError(
          'a call started inside the function of a transaction palisade opened was still running when it returned: await every call there',
        );
      }
    },
    closed: () => {
      if (savepoint) savepointOpen.delete(db);
    },
  };
}
