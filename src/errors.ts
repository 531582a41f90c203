/**
 * Every `code` a {@link PalisadeError} can carry, with what it means. This is
 * the one list: the README's error table is checked against it
 * (`test/errors.test.ts`), and `PalisadeErrorCode` is its keys.
 */
export const ERROR_CODES = {
  invalid_argument: 'bad input, caught before any query or command was sent',
  stale_fence: 'a fenced write was refused: a fence at least as high already wrote the row',
  row_missing: 'a fenced write found no live row for its key',
  retryable: 'serialization failure or deadlock (SQLSTATE 40001 / 40P01): nothing was written, retry',
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
 * Postgres refused the statement with a serialization failure (40001) or a
 * deadlock (40P01): nothing was written and the same write may be retried.
 * Under REPEATABLE READ / SERIALIZABLE a concurrent fenced write surfaces
 * this way — it is *not* a verdict that the fence is stale.
 */
export class RetryableWriteError extends PalisadeError {
  constructor(
    readonly sqlState: string,
    cause: unknown,
  ) {
    super('retryable', `write not applied, retry it (SQLSTATE ${sqlState})`, { cause });
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
  ) {
    super('lease_lost', `lease (fence ${fence}) lost: ${why}`);
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
