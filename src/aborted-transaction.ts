/**
 * A transaction aborted by a failed statement whose error was caught (or
 * never awaited): Postgres answers its COMMIT with a rollback, and nothing it
 * wrote is kept. The drivers pass such a COMMIT for a success where they do
 * not see the failure themselves (README, "Fenced transactions"), so:
 *
 * - postgres.js and PGlite: the statements of the transaction are watched;
 *   once its function returned, palisade waits for the ones still running,
 *   refuses any sent later, and — where one failed — asks the server with
 *   one `select 1` before the driver's COMMIT.
 * - node-postgres: the COMMIT's own answer (its command tag) and the
 *   statements' errors are read from the client's connection, on a pool's
 *   client as on a single `Client` (lost-connection.ts calls it).
 *
 * Either way the call rejects with the error of the statement that aborted
 * the transaction (a caught 40001 is still retryable), or 25P02 where
 * palisade did not see it. The success path sends nothing more.
 */
import { DatabaseError, InvalidArgumentError } from './errors.js';
import { endingState, sqlStateOf } from './server-error.js';

/**
 * @internal The failures seen in one transaction: the last one that could
 * have aborted it is what the call reports (later statements fail with
 * 25P02, which says nothing of why).
 */
export class Failures {
  #cause: unknown;
  #failed = false;
  #gone = false;

  note(err: unknown): void {
    const state = sqlStateOf(err);
    const code = (err as { code?: unknown } | null)?.code;
    // The client lost the session (or refused the statement): nothing reached the server.
    if (state === undefined) this.#gone ||= typeof code === 'string' && /^(CONNECT|E[A-Z]+$)/.test(code);
    else {
      this.#failed = true;
      if (state !== '25P02') this.#cause = err;
    }
  }

  /** Whether a statement failed on the server (so the transaction may be aborted), the client's session not lost. */
  get aborting(): boolean {
    return this.#failed && !this.#gone;
  }

  /**
   * Whether the last failure says the session is ending, or may be ({@link endingState}): a
   * statement sent to ask the server could go out on a closed connection. Not when the server said it as
   * a plain `ERROR` (postgres.js reads that word unlocalised): a live session raised it — a remote link's
   * class 08, say — and asking it is safe.
   */
  get ending(): boolean {
    const severity = (this.#cause as { severity?: unknown } | undefined)?.severity;
    return severity !== 'ERROR' && endingState(sqlStateOf(this.#cause));
  }

  /** The last failure that was not a 25P02, if any. */
  get cause(): unknown {
    return this.#cause;
  }

  /** The error a call whose COMMIT rolled back rejects with. */
  error(): unknown {
    return this.#cause ?? DatabaseError.commitRolledBack();
  }
}

// The failures of each transaction client palisade watches (its savepoints' clients too): seen as they
// come, or by statements looked at on demand.
const failuresOf = new WeakMap<object, Failures | Statements>();

/** @internal Notes that `client`'s failures are seen by `by` (until `client` is collected or {@link unwatch}ed). */
export function watch(client: object, by: Failures | Statements): void {
  failuresOf.set(client, by);
}

/** @internal Forgets `client`'s failures (a long-lived client, once its transaction ended). */
export function unwatch(client: object): void {
  failuresOf.delete(client);
}

/**
 * @internal `callback(tx)`, where a statement refused with 25P02 (the transaction is aborted) rejects with
 * the error that aborted it ({@link causeOf}): that is the news.
 */
export async function withCause<Tx, T>(tx: Tx, callback: (tx: Tx) => Promise<T>): Promise<T> {
  try {
    return await callback(tx);
  } catch (err) {
    throw await causeOf((tx as { session: { client: unknown } }).session.client, err);
  }
}

/**
 * @internal `err`, or — when it is a 25P02 ("current transaction is
 * aborted") out of a transaction on `client` whose failures palisade saw —
 * the error of the statement that aborted it: what the caller can act on
 * (a caught 40001 followed by palisade's own write is still retryable).
 */
export async function causeOf(client: unknown, err: unknown): Promise<unknown> {
  // A postgres.js client is a function.
  if (sqlStateOf(err) !== '25P02' || (typeof client !== 'object' && typeof client !== 'function')) return err;
  const by = client === null ? undefined : failuresOf.get(client);
  const failures = by instanceof Statements ? await by.seen() : by;
  return failures?.cause ?? err;
}

// A postgres.js query runs only once it is awaited (`executed`): palisade must not be what runs it.
interface Statement extends PromiseLike<unknown> {
  readonly executed?: boolean;
}

// How many statements wait to be looked at before they are (then twice as many as were left waiting).
const LOOK_EVERY = 32;

/** @internal Why a statement is not sent through a transaction palisade began once its function ended. */
export const sentAfterEnd = (): Error =>
  new InvalidArgumentError(
    'a statement was sent on a transaction whose function had ended: await every statement in it',
  );

/**
 * @internal The statements sent in one transaction (its savepoints' too):
 * how many still run, and which failed. Once {@link Statements.settled}
 * answered, or {@link Statements.end} was called, every later one is refused
 * ({@link Statements.refusal}).
 */
export class Statements {
  readonly failures = new Failures();
  #unlooked: Statement[] = [];
  #lookAt = LOOK_EVERY;
  #running = new Set<Statement>();
  #idle: (() => void)[] = [];
  #ended = false;

  /** Why a statement may not be sent now: the transaction's function has returned, or thrown. */
  refusal(): Error | undefined {
    return this.#ended ? sentAfterEnd() : undefined;
  }

  /**
   * The transaction's function threw: every later statement is refused at once. The driver's ROLLBACK
   * follows the statements sent so far; one sent after it would run in whatever the connection runs
   * next, or (postgres.js, a connection still describing a statement) wait behind it forever.
   */
  end(): void {
    this.#ended = true;
  }

  /** Notes `statement`, sent (or about to be) in the transaction; returns it. */
  sent<S>(statement: S): S {
    this.#unlooked.push(statement as Statement);
    if (this.#unlooked.length >= this.#lookAt) {
      this.#look();
      this.#lookAt = Math.max(LOOK_EVERY, this.#unlooked.length * 2);
    }
    return statement;
  }

  // Watches the statements that run; a postgres.js query nobody awaited yet stays unlooked.
  #look(): void {
    const waiting: Statement[] = [];
    for (const s of this.#unlooked) {
      if (s.executed === false) waiting.push(s);
      else this.#watch(s);
    }
    this.#unlooked = waiting;
  }

  #watch(s: Statement): void {
    this.#running.add(s);
    const done = () => {
      this.#running.delete(s);
      if (this.#running.size === 0) for (const idle of this.#idle.splice(0)) idle();
    };
    s.then(done, (err: unknown) => {
      this.failures.note(err);
      done();
    });
  }

  /**
   * Once the transaction's function returned: waits until no statement of
   * it runs (those sent meanwhile included), then refuses every later one.
   */
  async settled(): Promise<Failures> {
    let unawaited = 0;
    for (;;) {
      this.#look();
      if (this.#running.size > 0) await this.#whenIdle();
      else if (this.#unlooked.length > unawaited) {
        // Sent and not awaited yet: drizzle awaits its query a few microtasks on. One turn for them.
        unawaited = this.#unlooked.length;
        await nextTurn();
      } else break;
    }
    this.#ended = true;
    return this.failures;
  }

  /** The failures of the statements that ran so far, once those still running have settled. */
  async seen(): Promise<Failures> {
    this.#look();
    while (this.#running.size > 0) await this.#whenIdle();
    return this.failures;
  }

  /**
   * The statements that may not have settled: those running, and those not looked at yet (settled, running,
   * or not sent — a postgres.js query nobody awaited yet).
   */
  unsettled(): Statement[] {
    return [...this.#running, ...this.#unlooked];
  }

  #whenIdle(): Promise<void> {
    return new Promise<void>((resolve) => this.#idle.push(resolve));
  }
}

/**
 * @internal Where `failures` could have aborted the transaction, asks the
 * server with `probe` (a statement on the transaction's connection, past
 * palisade's guards): aborted (25P02), it throws the error that aborted it.
 */
export async function assertNotAborted(failures: Failures, probe: () => PromiseLike<unknown>): Promise<void> {
  if (!failures.aborting) return;
  try {
    await probe();
  } catch (err) {
    throw sqlStateOf(err) === '25P02' ? failures.error() : err;
  }
}

/**
 * @internal Resolves in a later turn of the event loop, in its timers phase. By then the loop has passed
 * the phase where a socket that failed in this turn reports its close (a reset's `close` comes after
 * the turn's `setImmediate`s), so a close is heard before palisade decides what to send; and a statement
 * the driver sends from there is flushed in the same turn, before any close that follows. postgres.js
 * flushes its write buffer from a `setImmediate`: bytes buffered in the check phase of the turn a reset
 * came in stayed in that buffer when the close came, and went out ahead of the next connect's startup,
 * which then never completed.
 */
export const nextTurn = (): Promise<void> => new Promise((resolve) => setTimeout(resolve, 0));

/** @internal A promise rejected with `error`, for whoever awaits it. */
export const rejected = (error: Error): Promise<never> => {
  const p = Promise.reject(error);
  p.catch(() => {}); // for whoever awaits it; no unhandled rejection for the ones nobody does
  return p;
};

/** The part of PGlite's transaction object drizzle sends statements through. */
interface PgliteTx {
  query(...args: unknown[]): Promise<unknown>;
  exec(...args: unknown[]): Promise<unknown>;
  sql(...args: unknown[]): Promise<unknown>;
}

/**
 * @internal PGlite: runs the driver's transaction call `begin(callback)` with
 * the statements of the transaction watched ({@link Statements}), and asks
 * the server before its COMMIT when one of them failed. `sessionOf` gives
 * the drizzle session of the transaction object the driver passes to the
 * callback.
 */
export function watchedPgliteTransaction<Tx, T>(
  begin: (callback: (tx: Tx) => Promise<T>) => Promise<T>,
  sessionOf: (tx: Tx) => { client: unknown },
  fn: (tx: Tx) => Promise<T>,
): Promise<T> {
  return begin(async (tx) => {
    const session = sessionOf(tx);
    const client = session.client as PgliteTx;
    const statements = new Statements();
    const watched =
      (method: keyof PgliteTx) =>
      (...args: unknown[]) => {
        const refused = statements.refusal();
        return refused ? rejected(refused) : statements.sent(client[method](...args));
      };
    const calls = { query: watched('query'), exec: watched('exec'), sql: watched('sql') };
    const proxy = new Proxy(client, {
      get: (target, key) => (Object.hasOwn(calls, key) ? calls[key as keyof PgliteTx] : Reflect.get(target, key)),
    });
    session.client = proxy;
    watch(proxy, statements);
    const value = await fn(tx);
    // In process: no session to lose, so any failure is asked about.
    await assertNotAborted(await statements.settled(), () => client.query('select 1'));
    return value;
  });
}

/** The messages of a node-postgres `Client`'s protocol connection palisade hears. */
interface MessageClient {
  readonly connection?: {
    on(event: 'commandComplete' | 'errorMessage' | 'readyForQuery', listener: (message: never) => void): unknown;
    removeListener(
      event: 'commandComplete' | 'errorMessage' | 'readyForQuery',
      listener: (message: never) => void,
    ): unknown;
  };
}

/**
 * @internal A node-postgres client in a transaction: the command tags and
 * errors of its connection, heard from now on (`failures`, for
 * {@link causeOf}). `check()`, once the driver's COMMIT was answered,
 * throws the error that aborted the transaction when the COMMIT's tag says
 * `ROLLBACK`; `open()` says whether the server may still be in the
 * transaction; `off()` stops listening. Nothing is heard on a client without
 * a protocol connection (pg-native).
 */
export function commitAnswer(client: unknown): {
  readonly failures: Failures;
  check(): void;
  open(): boolean;
  off(): void;
} {
  const connection = (client as MessageClient).connection;
  const failures = new Failures();
  let tag: unknown;
  // The session's transaction status as its last ReadyForQuery said: in a transaction ('T', or 'E' failed)
  // until one says idle ('I'). Heard from after BEGIN, which the driver sent first.
  let status: unknown = 'T';
  const heard = typeof connection?.on === 'function';
  const onComplete = (message: { text?: unknown }) => {
    tag = message.text;
  };
  const onError = (message: unknown) => failures.note(message);
  const onReady = (message: { status?: unknown }) => {
    status = message.status;
  };
  if (heard) {
    connection.on('commandComplete', onComplete);
    connection.on('errorMessage', onError);
    connection.on('readyForQuery', onReady);
  }
  return {
    failures,
    check() {
      if (tag === 'ROLLBACK') throw failures.error();
    },
    // Once the driver's COMMIT or ROLLBACK settled: not idle means the server never answered it — the client gave
    // up first (node-postgres's query_timeout: on a statement still running there, and then on the ROLLBACK
    // queued behind it, which is never sent), and the session is still in the transaction.
    open: () => heard && status !== 'I',
    off() {
      connection?.removeListener('commandComplete', onComplete);
      connection?.removeListener('errorMessage', onError);
      connection?.removeListener('readyForQuery', onReady);
    },
  };
}
