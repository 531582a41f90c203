/**
 * Every error palisade throws is a {@link PalisadeError} with a stable string
 * `code`, so callers can branch on `err.code` without `instanceof` across
 * package copies. Messages name tables, keys' column names, SQLSTATEs,
 * constraints and fences — never row values, query parameters, lock names or
 * holder labels, which may be secrets (lock names are on the errors'
 * `lockName` property).
 */
export class PalisadeError extends Error {
  /** Stable, machine-readable identifier of the failure. */
  readonly code: string;

  constructor(code: string, message: string, options?: { cause?: unknown }) {
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
 * A lock-manager call (`release`, `inspect`; `extend` reports it as a lost
 * lease) waited for a *database* lock longer than its bound (`lockTimeoutMs`)
 * — say an operator's `VACUUM FULL` of the lease table. The server cancelled
 * the statement (`lock_timeout`), so it changed nothing: a release that timed
 * out leaves the lock to expire at its TTL.
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
