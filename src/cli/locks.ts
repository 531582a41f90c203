/**
 * `palisade locks`: who holds what in the Postgres lease table
 * (`palisade.leases`, the Postgres lock manager's), by the server's clock.
 */
import { CliError } from '../errors.js';
import {
  type Command,
  connect,
  connectionError,
  formatDuration,
  parse,
  requireDatabaseUrl,
  table,
  toJson,
} from './common.js';
import { registersCommand, resetRegisterCommand } from './registers.js';

const help = `Usage: palisade locks [--namespace NS] [--expired] [--limit N] [--json]
       palisade locks registers [--namespace NS] [--json]
       palisade locks reset-register --kind K --source S --namespace NS --name N (--fence F | --delete)
                                     [--expect E] [--create] [--wait-ms MS]

Lists the leases of palisade's Postgres lock manager (table palisade.leases):
lock name, holder, fence, age and remaining TTL, by the database's clock.
A lease whose TTL has run out is free to take; it is listed only with --expired.
Released leases are never listed.

Options:
  --namespace NS  only this lock-manager namespace (default: all)
  --expired       include leases whose TTL has run out (not yet taken over)
  --limit N       at most N leases (default 1000)
  --json          print the leases as JSON on stdout (fence as a decimal string)
  -h, --help      this help

Environment:
  DATABASE_URL    the Postgres whose lease table to read (required)

Not shown: Redis leases (they live in Redis) and advisory locks (see pg_locks).`;

/** One row of `palisade locks --json`. */
export interface LockRow {
  readonly namespace: string;
  readonly name: string;
  readonly holder: string | null;
  /** Decimal string: fences go past 2^53. */
  readonly fence: string;
  readonly acquiredAt: string;
  readonly ageMs: number;
  /** Negative once expired. */
  readonly remainingMs: number;
  readonly expired: boolean;
}

export const locksCommand: Command = {
  summary: 'list who holds which lock (Postgres lease table), with fence, age and TTL left',
  help,
  async run(argv, io) {
    if (argv[0] === 'registers') return registersCommand.run(argv.slice(1), io);
    if (argv[0] === 'reset-register') return resetRegisterCommand.run(argv.slice(1), io);
    const { values } = parse('locks', argv, {
      namespace: { type: 'string' },
      expired: { type: 'boolean' },
      limit: { type: 'string' },
      json: { type: 'boolean' },
    });
    if (values.help) {
      io.out(help);
      return 0;
    }
    const limit = values.limit === undefined ? 1000 : Number(values.limit);
    if (!Number.isSafeInteger(limit) || limit < 1) throw new CliError('--limit must be a positive integer', 2);
    const namespace = values.namespace === undefined ? null : String(values.namespace);
    const url = requireDatabaseUrl(io, 'palisade locks reads the lease table of a Postgres server');
    const sql = await connect(url);
    try {
      let rows: Record<string, unknown>[];
      try {
        // Released leases keep their row (token '', expires_at -infinity): never listed.
        rows = await sql`
          select namespace, name, holder, fence::text as fence, acquired_at,
                 (extract(epoch from (clock_timestamp() - acquired_at)) * 1000)::float8 as age_ms,
                 (extract(epoch from (expires_at - clock_timestamp())) * 1000)::float8 as remaining_ms
          from palisade.leases
          where token <> '' and expires_at > '-infinity'::timestamptz
            and (${namespace}::text is null or namespace = ${namespace}::text)
            and (expires_at > clock_timestamp() or ${values.expired === true}::boolean)
          order by namespace, name
          limit ${limit}`;
      } catch (err) {
        if ((err as { code?: unknown }).code === '42P01') {
          throw new CliError('no palisade.leases table in this database: run `palisade migrate` first');
        }
        throw connectionError(err, url);
      }
      const locks: LockRow[] = rows.map((r) => ({
        namespace: String(r.namespace),
        name: String(r.name),
        holder: r.holder === null ? null : String(r.holder),
        fence: String(r.fence),
        acquiredAt: new Date(r.acquired_at as string | Date).toISOString(),
        ageMs: Math.round(Number(r.age_ms)),
        remainingMs: Math.round(Number(r.remaining_ms)),
        expired: Number(r.remaining_ms) <= 0,
      }));
      if (values.json) {
        io.out(toJson(locks));
        return 0;
      }
      if (locks.length === 0) {
        io.out(namespace === null ? 'no locks held' : `no locks held in namespace ${namespace}`);
        return 0;
      }
      io.out(
        table(
          ['NAMESPACE', 'NAME', 'HOLDER', 'FENCE', 'AGE', 'TTL LEFT'],
          locks.map((l) => [
            l.namespace,
            l.name,
            l.holder ?? '-',
            l.fence,
            formatDuration(l.ageMs),
            l.expired ? `expired ${formatDuration(-l.remainingMs)} ago` : formatDuration(l.remainingMs),
          ]),
        ),
      );
      if (locks.length === limit) io.err(`(showing the first ${limit}; raise --limit to see more)`);
      return 0;
    } finally {
      await sql.end({ timeout: 5 });
    }
  },
};
