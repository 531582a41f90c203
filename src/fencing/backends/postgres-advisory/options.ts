/** The options of the advisory backend; the README's "Postgres leases and advisory locks" section is the manual. */
import type postgres from 'postgres';
import type { ClaimRegistersOption } from '../../eager-claim.js';

/** Options of `advisoryLockManager` and `advisoryLockBackend`. */
export interface AdvisoryLockManagerOptions {
  /**
   * A postgres.js client of a real Postgres (14 or later) where `migrate()`
   * has run, connected directly or through a *session*-mode pooler. Lease
   * sessions are new connections with the same settings; the client itself
   * runs only `inspect`, the one-time checks and LISTEN.
   */
  readonly client: postgres.Sql;
  /** Separates lock sets: 1–100 characters of `[A-Za-z0-9_.-]`; part of the 64-bit key. Fences are shared by every namespace. */
  readonly namespace: string;
  /** Released sessions kept open for the next grant (default 1, at most 16). */
  readonly maxIdleSessions?: number;
  /**
   * The longest a lease session's extend or release waits for a database
   * lock, in ms (the sessions' `lock_timeout`), 1 … 86,400,000; default
   * 5,000. A grant waits at most what is left of the acquire's `waitMs`.
   */
  readonly lockTimeoutMs?: number;
  /**
   * How long a call may take beyond its server-side lock wait before it
   * fails with `CommandTimeoutError` (a connection that stops answering), in
   * ms, 1 … 600,000; default 10,000. A grant that fails so ends its session,
   * which frees whatever lock it took; a release that fails so ends it too.
   */
  readonly commandTimeoutMs?: number;
  /**
   * The eager claim at acquire (README, "When each backend claims"): each
   * grant claims its lock's register in `db`, the fenced tables' database when
   * it is not `client`'s (on `client` itself every grant claims already),
   * before `acquire` resolves, so a stale holder is refused on every row
   * before the new holder writes. One statement on `db` per grant. A grant
   * that finds a higher fence there is released and the acquire fails with
   * `FenceSourceError`.
   */
  readonly claimRegisters?: ClaimRegistersOption;
}

/** True for a postgres.js client (a function with `unsafe` and parsed `options`). */
export function isPostgresJs(value: unknown): value is postgres.Sql {
  return (
    typeof value === 'function' &&
    typeof (value as { unsafe?: unknown }).unsafe === 'function' &&
    typeof (value as { options?: unknown }).options === 'object' &&
    (value as { options?: unknown }).options !== null
  );
}
