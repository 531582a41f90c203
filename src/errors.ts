/**
 * Every error class palisade throws, and the one list of their codes. The
 * README's "Errors" section is the manual; `test/readme.test.ts` checks its
 * table against {@link ERROR_CODES} and {@link ERROR_CLASSES}.
 */
import { describeServerError } from './server-error.js';

/**
 * Every `code` a {@link PalisadeError} can carry, with what it means. This is
 * the one list: `PalisadeErrorCode` is its keys, and every code has its class
 * in {@link ERROR_CLASSES}.
 */
export const ERROR_CODES = {
  invalid_argument: 'bad input, caught before any query or command was sent',
  stale_fence: 'a fenced write was refused: a fence at least as high already wrote the row',
  row_missing: 'a fenced write found no live row for its key',
  retryable:
    'serialization failure or deadlock (SQLSTATE 40001 / 40P01), or a write that kept racing its refusal: nothing was written, retry',
  lock_unavailable: 'a bounded wait for a lock ended (timeout or abort) without a grant',
  lock_timeout:
    'a lock-manager call waited for a database lock longer than lockTimeoutMs; the statement was cancelled and changed nothing',
  lease_lost: 'the lease is known or presumed lost',
  fence_source: 'the fence source cannot prove its next fence is above every earlier one',
  lock_service: 'the lock service (Redis, etcd) could not be reached or failed; the message says why',
  command_timeout: 'a Redis command or Postgres statement did not answer within commandTimeoutMs',
  database: 'Postgres refused a statement for a reason palisade does not interpret (the SQLSTATE is kept)',
  driver: 'the database driver returned something palisade does not recognise',
  unsupported_database: 'the database cannot do what was asked (advisory locks on PGlite)',
  foreign_lock: 'an advisory lock is held by a session that is not a palisade lease',
  closed: 'the lock manager was closed',
  missing_dependency: 'an optional peer dependency is not installed; the message names the package',
  migrations_folder: 'a migrations folder is missing or is not a drizzle-kit folder; the message names the path',
  lock_scope:
    "a write bypassed the lock scope: a bare-fence write on a repository created with scope: 'lock', or a holder without a lock identity there",
  fence_not_issued:
    'a lock-scoped write carried a fence that this database never granted for its lock (forged or miscomputed); nothing was written',
  cli: 'the `palisade` command failed or was used wrongly; the message says why (exit code 1 or 2)',
} as const;

/** A {@link PalisadeError}'s `code`: a key of {@link ERROR_CODES}. */
export type PalisadeErrorCode = keyof typeof ERROR_CODES;

/**
 * Every error palisade throws is a {@link PalisadeError} with a stable string
 * `code`, so callers can branch on `err.code` without `instanceof` across
 * package copies. Messages name tables, keys' column names, SQLSTATEs,
 * constraints and fences — never row values, query parameters, lock names or
 * holder labels, which may be secrets (lock names are on the errors'
 * `lockName` property).
 */
export class PalisadeError extends Error {
  /** Stable, machine-readable identifier of the failure: one of {@link ERROR_CODES}. */
  readonly code: PalisadeErrorCode;

  constructor(code: PalisadeErrorCode, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.code = code;
    this.name = new.target.name;
  }
}

/** Bad input, caught before any query or command is sent. */
export class InvalidArgumentError extends PalisadeError {
  constructor(message: string) {
    super('invalid_argument', message);
  }
}

/**
 * A fenced write was refused because a fence at least as high had already
 * written the row. Thrown by the `…OrThrow` forms and {@link mustApply}.
 */
export class StaleFenceError extends PalisadeError {
  constructor(
    readonly table: string,
    /** Primary-key column names → values, as the caller passed them. */
    readonly key: Readonly<Record<string, unknown>>,
    readonly attemptedFence: bigint,
    /** The row's fence when the write was refused; `null` if unknown. */
    readonly currentFence: bigint | null,
  ) {
    super(
      'stale_fence',
      `stale write to ${table}: fence ${attemptedFence} is not above the row's fence ${currentFence ?? '(unknown)'}`,
    );
  }
}

/** A fenced write targeted a row that does not exist (or is a tombstone). */
export class RowMissingError extends PalisadeError {
  constructor(readonly table: string) {
    super('row_missing', `no live row in ${table} for the given key`);
  }
}

/**
 * Nothing was written and the same write may be retried. Postgres refused
 * the statement with a serialization failure (40001) or a deadlock (40P01)
 * — under REPEATABLE READ / SERIALIZABLE a concurrent fenced write surfaces
 * this way, and it is *not* a verdict that the fence is stale — or
 * (`reason: 'race'`) the row changed between a refused write and the
 * statement that explains the refusal, more often than a bounded re-check
 * could settle.
 */
export class RetryableWriteError extends PalisadeError {
  /** The SQLSTATE (`40001`, `40P01`) when the server refused; `undefined` for a race. */
  readonly sqlState: string | undefined;

  constructor(
    readonly reason: 'serialization_failure' | 'deadlock' | 'race',
    cause?: unknown,
  ) {
    const sqlState = reason === 'serialization_failure' ? '40001' : reason === 'deadlock' ? '40P01' : undefined;
    super(
      'retryable',
      sqlState
        ? `write not applied, retry it (SQLSTATE ${sqlState})`
        : 'write not applied, retry it (the row kept changing while the refusal was explained)',
      { cause },
    );
    this.sqlState = sqlState;
  }
}

/** A bounded wait for a lock ended without a grant. */
export class LockUnavailableError extends PalisadeError {
  constructor(
    readonly lockName: string,
    readonly reason: 'timeout' | 'aborted',
  ) {
    // The name is a property, not part of the message: lock names can carry customer data (`account:<id>`).
    super('lock_unavailable', `lock not acquired (${reason})`);
  }
}

/**
 * `inspect` waited for a *database* lock longer than its bound
 * (`lockTimeoutMs`) — say an operator's `VACUUM FULL` of the lease table. The
 * server cancelled the statement (`lock_timeout`), so it changed nothing.
 * (An `extend` that times out loses the lease; a `release` returns `'lost'`
 * and the lock expires at its TTL: neither throws this to the caller.)
 */
export class LockTimeoutError extends PalisadeError {
  constructor(
    readonly lockName: string,
    readonly operation: 'extend' | 'release' | 'inspect',
    readonly sqlState: string,
  ) {
    super(
      'lock_timeout',
      `${operation} gave up waiting for a database lock (SQLSTATE ${sqlState}); the statement was cancelled and changed nothing`,
    );
  }
}

/** The lease is known or presumed lost: its signal aborts with this. */
export class LeaseLostError extends PalisadeError {
  constructor(
    readonly lockName: string,
    readonly fence: bigint,
    why: string,
    options?: { cause?: unknown },
  ) {
    super('lease_lost', `lease (fence ${fence}) lost: ${why}`, options);
  }
}

/**
 * The fence source cannot prove its next fence is above every fence it issued
 * before (a counter went missing and no durable floor is configured, or a
 * sequence is set up unsafely). palisade refuses rather than reissue fences.
 */
export class FenceSourceError extends PalisadeError {
  constructor(message: string) {
    super('fence_source', message);
  }
}

/**
 * The lock service (Redis, etcd) could not be reached or failed, so palisade
 * cannot say whether the lock is free. `acquire` retries such failures
 * within its `waitMs` and throws this when the wait is spent; the cause (the
 * client's own error) is kept.
 */
export class LockServiceError extends PalisadeError {
  constructor(
    /** `redis`, `etcd`, `postgres`, `advisory`: the backend that failed. */
    readonly service: string,
    message: string,
    cause?: unknown,
  ) {
    super('lock_service', message, { cause });
  }
}

/** An optional peer dependency is not installed: `npm i <packageName>`. */
export class MissingDependencyError extends PalisadeError {
  constructor(
    readonly packageName: string,
    purpose: string,
    cause?: unknown,
  ) {
    super('missing_dependency', `${purpose} needs the package "${packageName}": npm i ${packageName}`, { cause });
  }
}

/** A migrations folder is missing or is not a drizzle-kit folder. */
export class MigrationsFolderError extends PalisadeError {
  constructor(
    readonly folder: string,
    message: string,
    cause?: unknown,
  ) {
    super('migrations_folder', message, { cause });
  }
}

/**
 * A write that would bypass the lock scope: a bare-fence write (row scope)
 * on a repository created with `scope: 'lock'`, or `with(holder)` there for
 * a holder that has no `lock`. Thrown before any query.
 */
export class LockScopeError extends PalisadeError {
  constructor(message: string) {
    super('lock_scope', message);
  }
}

/**
 * A lock-scoped write carried a fence that is not the latest grant of its
 * lock, though the lock's grants claim its register on this very database
 * (Postgres leases and advisory locks on the fenced tables' database): a
 * forged or miscomputed fence above every grant. Nothing was written and
 * nothing was claimed. A fence *below* the latest grant is `stale` instead.
 */
export class FenceNotIssuedError extends PalisadeError {
  constructor(
    /** The register's fence: the lock's latest grant (0 when this database never granted the lock). */
    readonly registeredFence: bigint,
    readonly attemptedFence: bigint,
  ) {
    super(
      'fence_not_issued',
      `fence ${attemptedFence} was never granted for this lock here: its latest grant is ${registeredFence}`,
    );
  }
}

/**
 * The database refused a statement for a reason palisade does not interpret.
 *
 * What the message says, and what it never says: it keeps the SQLSTATE, its
 * condition name, and the schema, table, column and constraint the server
 * names in its error fields. It never carries a value: the server's own text
 * quotes values for data errors (`invalid input syntax for type integer:
 * "…"`), its DETAIL quotes the failing row, and drizzle's error lists the
 * query's parameters. So the server's text is kept only for the classes
 * whose messages are about the statement, the schema or the server
 * (`SERVER_TEXT_CLASSES` in `server-error.ts`), never DETAIL, HINT or WHERE; the driver's
 * error is not kept either: `cause` is a sanitised copy with the same
 * fields and nothing else (`console.log(err)` prints causes).
 */
export class DatabaseError extends PalisadeError {
  /** The schema, table, column, data type and constraint named by the server, when it names them. */
  readonly schema: string | undefined;
  readonly table: string | undefined;
  readonly column: string | undefined;
  readonly dataType: string | undefined;
  readonly constraint: string | undefined;

  constructor(
    readonly sqlState: string | undefined,
    cause: unknown,
    /**
     * True when a transaction palisade began (a fenced transaction, a
     * `modify`, a lock-scoped write's claim) had sent its COMMIT, or a write
     * was sent on its own (outside any transaction), and no answer of the
     * server's says it failed — the connection was lost, or the client gave
     * up waiting (a socket error, node-postgres's `query_timeout`): whether
     * it committed is unknown — read the rows again to know. False for every
     * other failure, after which nothing the transaction or the write wrote
     * is kept.
     */
    readonly outcomeUnknown = false,
  ) {
    const safe = describeServerError(cause, sqlState);
    super(
      'database',
      outcomeUnknown
        ? `${safe.message} (no answer that says it failed: whether it committed is unknown)`
        : safe.message,
      {
        cause: safe.error,
      },
    );
    this.schema = safe.fields.schema;
    this.table = safe.fields.table;
    this.column = safe.fields.column;
    this.dataType = safe.fields.dataType;
    this.constraint = safe.fields.constraint;
  }

  /**
   * @internal A statement refused before it was sent: the server had closed
   * its transaction's connection (src/lost-connection.ts). Reads like the
   * driver's own error for a connection that closed under a query.
   */
  static connectionClosed(): DatabaseError {
    const cause = Object.assign(new Error("the transaction's connection was closed"), { code: 'CONNECTION_CLOSED' });
    return new DatabaseError(undefined, cause);
  }

  /**
   * @internal A COMMIT that Postgres answered with a rollback: a statement of the transaction had failed
   * (and its error was caught), so nothing it wrote was kept (src/aborted-transaction.ts).
   */
  static commitRolledBack(): DatabaseError {
    const cause = Object.assign(
      new Error('the transaction was aborted by a failed statement whose error was caught: its COMMIT rolled back'),
      { code: '25P02' },
    );
    return new DatabaseError('25P02', cause);
  }
}

/** A Redis command or Postgres statement did not answer within `commandTimeoutMs`. */
export class CommandTimeoutError extends PalisadeError {
  constructor(what: string, ms: number) {
    super('command_timeout', `${what} did not answer within ${ms} ms (it may still run)`);
  }
}

/** The database driver returned something palisade does not recognise (a result shape, a value type). */
export class DriverError extends PalisadeError {
  constructor(message: string) {
    super('driver', message);
  }
}

/** The database cannot do what was asked: advisory locks on PGlite, which grants every one. */
export class UnsupportedDatabaseError extends PalisadeError {
  constructor(message: string) {
    super('unsupported_database', message);
  }
}

/** An advisory lock is held by a session that is not a palisade lease (another user of the same 64-bit key). */
export class ForeignLockError extends PalisadeError {
  constructor(readonly lockName: string) {
    // The name is a property, not part of the message (see LockUnavailableError).
    super('foreign_lock', 'the advisory lock is held by a session that is not a palisade lease (same 64-bit key)');
  }
}

/** The lock manager was closed: it grants, extends and inspects nothing any more. */
export class LockManagerClosedError extends PalisadeError {
  constructor(what: string) {
    super('closed', `this ${what} is closed`);
  }
}

/** A failure of the `palisade` command, reported as one line on stderr with its exit code (1: failed, 2: bad usage). */
export class CliError extends PalisadeError {
  constructor(
    message: string,
    readonly exitCode = 1,
    cause?: unknown,
  ) {
    super('cli', message, cause === undefined ? undefined : { cause });
  }
}

/** The class of each code: what `err.code === code` lets a caller narrow to. */
export const ERROR_CLASSES = {
  invalid_argument: InvalidArgumentError,
  stale_fence: StaleFenceError,
  row_missing: RowMissingError,
  retryable: RetryableWriteError,
  lock_unavailable: LockUnavailableError,
  lock_timeout: LockTimeoutError,
  lease_lost: LeaseLostError,
  fence_source: FenceSourceError,
  lock_service: LockServiceError,
  command_timeout: CommandTimeoutError,
  database: DatabaseError,
  driver: DriverError,
  unsupported_database: UnsupportedDatabaseError,
  foreign_lock: ForeignLockError,
  closed: LockManagerClosedError,
  missing_dependency: MissingDependencyError,
  migrations_folder: MigrationsFolderError,
  cli: CliError,
  lock_scope: LockScopeError,
  fence_not_issued: FenceNotIssuedError,
} as const satisfies Record<PalisadeErrorCode, abstract new (...args: never[]) => PalisadeError>;
