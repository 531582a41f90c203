/**
 * The one error list: every code of ERROR_CODES has its class, every class
 * sets its own code, and nothing else in src/ declares an error class or
 * throws a plain Error a caller could see.
 */
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { translateError } from '../src/driver.js';
import {
  CliError,
  CommandTimeoutError,
  DatabaseError,
  DriverError,
  ERROR_CLASSES,
  ERROR_CODES,
  FenceNotIssuedError,
  FenceSourceError,
  ForeignLockError,
  InvalidArgumentError,
  LeaseLostError,
  LockManagerClosedError,
  LockScopeError,
  LockServiceError,
  LockTimeoutError,
  LockUnavailableError,
  MigrationsFolderError,
  MissingDependencyError,
  PalisadeError,
  type PalisadeErrorCode,
  RetryableWriteError,
  RowMissingError,
  StaleFenceError,
  UnsupportedDatabaseError,
} from '../src/errors.js';
import { endingState, sessionEnded } from '../src/server-error.js';

/** One instance per code; the type makes a new code without a sample fail to compile. */
const samples: { readonly [K in PalisadeErrorCode]: PalisadeError } = {
  invalid_argument: new InvalidArgumentError('bad'),
  stale_fence: new StaleFenceError('t', { id: 1 }, 2n, 3n),
  row_missing: new RowMissingError('t'),
  retryable: new RetryableWriteError('race'),
  lock_unavailable: new LockUnavailableError('l', 'timeout'),
  lock_timeout: new LockTimeoutError('l', 'inspect', '55P03'),
  lease_lost: new LeaseLostError('l', 1n, 'expired'),
  fence_source: new FenceSourceError('gone'),
  lock_service: new LockServiceError('redis', 'down'),
  command_timeout: new CommandTimeoutError('GET', 5),
  database: new DatabaseError('23514', new Error('boom')),
  driver: new DriverError('odd'),
  unsupported_database: new UnsupportedDatabaseError('pglite'),
  foreign_lock: new ForeignLockError('l'),
  closed: new LockManagerClosedError('lock manager'),
  missing_dependency: new MissingDependencyError('ioredis', 'redisLockManager'),
  migrations_folder: new MigrationsFolderError('./drizzle', 'missing'),
  cli: new CliError('usage', 2),
  lock_scope: new LockScopeError('bare fence'),
  fence_not_issued: new FenceNotIssuedError(3n, 1000n),
};

describe('errors', () => {
  it('ERROR_CLASSES has exactly the codes of ERROR_CODES', () => {
    expect(Object.keys(ERROR_CLASSES).sort()).toEqual(Object.keys(ERROR_CODES).sort());
  });

  it.each(Object.keys(ERROR_CODES) as PalisadeErrorCode[])('%s: its class sets that code', (code) => {
    const err = samples[code];
    expect(err).toBeInstanceOf(ERROR_CLASSES[code]);
    expect(err).toBeInstanceOf(PalisadeError);
    expect(err.code).toBe(code);
    expect(err.name).toBe(ERROR_CLASSES[code].name);
  });

  it('no class is the class of two codes', () => {
    const classes = Object.values(ERROR_CLASSES);
    expect(new Set(classes).size).toBe(classes.length);
  });

  it('a retryable error says why in `reason`, and its sqlState is a real SQLSTATE or nothing', () => {
    expect(new RetryableWriteError('race')).toMatchObject({ reason: 'race', sqlState: undefined });
    expect(new RetryableWriteError('serialization_failure')).toMatchObject({ sqlState: '40001' });
    expect(new RetryableWriteError('deadlock')).toMatchObject({ sqlState: '40P01' });
  });

  it('src/ declares error classes only in src/errors.ts and throws no plain Error outside the demo worker', () => {
    const offenders: string[] = [];
    const walk = (dir: string): void => {
      for (const entry of readdirSync(dir, { withFileTypes: true })) {
        const path = join(dir, entry.name);
        if (entry.isDirectory()) walk(path);
        else if (path.endsWith('.ts') && path !== join('src', 'errors.ts')) {
          const text = readFileSync(path, 'utf8');
          for (const [, name] of text.matchAll(/class (\w+) extends \w*Error\b/g)) {
            // lock-manager.ts's AttemptCutShort is control flow that never leaves the file.
            if (name !== 'AttemptCutShort') offenders.push(`${path}: declares ${name}`);
          }
          if (/\bnew Error\(/.test(text) && !ALLOWED_PLAIN_ERRORS.has(path)) offenders.push(`${path}: new Error(`);
        }
      }
    };
    walk('src');
    expect(offenders).toEqual([]);
  });
});

/**
 * Files allowed a plain `Error`: the server-error copy (a sanitised stand-in
 * for the driver's error, only ever a `cause`), the demo worker (a child
 * process whose failures the demo reports as a CliError) and the testing
 * helpers' assertion failures: the stale-write helper's and the backend
 * contract suite's (a failed test, not a library error).
 */
const ALLOWED_PLAIN_ERRORS = new Set([
  join('src', 'server-error.ts'),
  join('src', 'cli', 'demo-worker.ts'),
  join('src', 'testing', 'stale-write.ts'),
  join('src', 'testing', 'contract-checks.ts'),
  join('src', 'testing', 'contract-process.ts'),
]);

describe('a session that ended, as the drivers report it', () => {
  const coded = (message: string, code: string) => Object.assign(new Error(message), { code });
  it('is told from a statement that failed, in the driver error and in palisade’s DatabaseError of it', () => {
    const ended = [
      coded('terminating connection due to idle-in-transaction timeout', '25P03'),
      coded('terminating connection due to administrator command', '57P01'),
      coded('write CONNECTION_CLOSED 127.0.0.1:5432', 'CONNECTION_CLOSED'),
      // Of a SQLSTATE's shape, but a socket's code.
      coded('write EPIPE', 'EPIPE'),
      new Error('Connection terminated unexpectedly'),
      new Error('Client has encountered a connection error and is not queryable'),
      DatabaseError.connectionClosed(),
    ];
    const failed = [
      coded('duplicate key value violates unique constraint', '23505'),
      coded('deadlock detected', '40P01'),
      DatabaseError.commitRolledBack(),
      new Error('Connection terminated unexpectedly, and more'),
      new TypeError('a bug in the caller’s function'),
      new LeaseLostError('L', 1n, 'released'),
    ];
    for (const err of ended) {
      expect([err.message, sessionEnded(err)]).toEqual([err.message, true]);
      expect([err.message, sessionEnded(translateError(err))]).toEqual([err.message, true]);
    }
    for (const err of failed) expect([err.message, sessionEnded(err)]).toEqual([err.message, false]);
  });

  it('the SQLSTATEs of a session that ends are one list, which a fenced transaction also reads before it asks the server', () => {
    expect(['25P03', '57P01', '57P02', '57P03', '08006', '08003'].map(endingState)).toEqual(Array(6).fill(true));
    expect(['57014', '25P02', '40001', '23505', undefined].map(endingState)).toEqual(Array(5).fill(false));
  });

  it("keeps node-postgres's fixed text of a closed connection, which names no data, with postgres.js's code for it", () => {
    const err = new DatabaseError(undefined, new Error('Connection terminated unexpectedly'));
    expect(err.message).toBe('database error: Connection terminated unexpectedly');
    expect((err.cause as { code?: unknown }).code).toBe('CONNECTION_ENDED');
    expect(new DatabaseError(undefined, new Error('secret 42')).message).toBe('database error: Error from the driver');
  });
});
