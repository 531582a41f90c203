/**
 * `palisade locks registers` and `palisade locks reset-register`: the lock
 * registers of lock-scoped fencing (README, "Two scopes of fencing",
 * "Resetting a register").
 */
import { CliError } from '../errors.js';
import { type Command, connect, connectionError, parse, requireDatabaseUrl, table, toJson } from './common.js';

const listHelp = `Usage: palisade locks registers [--namespace NS] [--limit N] [--json]

Lists palisade.lock_registers: for each lock that lock-scoped writes or grants
claimed, its backend kind, fence source, namespace, name and highest fence.

Options:
  --namespace NS  only this namespace
  --limit N       at most N rows (default 1000)
  --json          JSON on stdout (fence as a decimal string)
  -h, --help      this help

Environment:
  DATABASE_URL    the Postgres that holds the fenced tables (required)`;

const resetHelp = `Usage: palisade locks reset-register --kind K --source S --namespace NS --name N (--fence F | --delete)

Sets one lock register to fence F, or deletes it. Use it only when a register
holds a fence that was never granted (a forged or miscomputed number) and so
refuses every lock-scoped write of that lock: set it to the highest fence the
lock's backend has really granted (its current holder's fence). Setting it
lower than a fence a live or paused holder carries lets that holder's late
writes land again; deleting it does the same for every fence of the lock.
Prints the register's fence before and after.

Options:
  --kind K        backend kind: postgres, advisory, redis, etcd, …
  --source S      fence source id (see palisade locks registers)
  --namespace NS  lock-manager namespace
  --name N        lock name
  --fence F       the fence to set (a positive integer)
  --delete        delete the register instead
  --json          JSON on stdout
  -h, --help      this help

Environment:
  DATABASE_URL    the Postgres that holds the fenced tables (required)`;

const missingTable = (err: unknown) => (err as { code?: unknown }).code === '42P01';
const NO_TABLE = 'no palisade.lock_registers table in this database: run `palisade migrate` first';

/** `palisade locks registers`. */
export const registersCommand: Command = {
  summary: 'list lock registers (lock-scoped fencing)',
  help: listHelp,
  async run(argv, io) {
    const { values } = parse('locks registers', argv, {
      namespace: { type: 'string' },
      limit: { type: 'string' },
      json: { type: 'boolean' },
    });
    if (values.help) {
      io.out(listHelp);
      return 0;
    }
    const limit = values.limit === undefined ? 1000 : Number(values.limit);
    if (!Number.isSafeInteger(limit) || limit < 1) throw new CliError('--limit must be a positive integer', 2);
    const namespace = values.namespace === undefined ? null : String(values.namespace);
    const url = requireDatabaseUrl(io, 'palisade locks registers reads palisade.lock_registers');
    const sql = await connect(url);
    try {
      let rows: Record<string, unknown>[];
      try {
        rows = await sql`select kind, source, namespace, name, fence::text as fence from palisade.lock_registers
          where (${namespace}::text is null or namespace = ${namespace}::text)
          order by kind, source, namespace, name limit ${limit}`;
      } catch (err) {
        if (missingTable(err)) throw new CliError(NO_TABLE);
        throw connectionError(err, url);
      }
      const registers = rows.map((r) => ({
        kind: String(r.kind),
        source: String(r.source),
        namespace: String(r.namespace),
        name: String(r.name),
        fence: String(r.fence),
      }));
      if (values.json) io.out(toJson(registers));
      else if (registers.length === 0) io.out('no lock registers');
      else {
        io.out(
          table(
            ['KIND', 'SOURCE', 'NAMESPACE', 'NAME', 'FENCE'],
            registers.map((r) => [r.kind, r.source, r.namespace, r.name, r.fence]),
          ),
        );
      }
      return 0;
    } finally {
      await sql.end({ timeout: 5 });
    }
  },
};

/** `palisade locks reset-register`. */
export const resetRegisterCommand: Command = {
  summary: 'set or delete one lock register (operator repair)',
  help: resetHelp,
  async run(argv, io) {
    const { values } = parse('locks reset-register', argv, {
      kind: { type: 'string' },
      source: { type: 'string' },
      namespace: { type: 'string' },
      name: { type: 'string' },
      fence: { type: 'string' },
      delete: { type: 'boolean' },
      json: { type: 'boolean' },
    });
    if (values.help) {
      io.out(resetHelp);
      return 0;
    }
    const key = ['kind', 'source', 'namespace', 'name'].map((k) => {
      const v = values[k];
      if (typeof v !== 'string' || (k !== 'namespace' && v.length === 0)) throw new CliError(`--${k} is required`, 2);
      return v;
    }) as [string, string, string, string];
    const remove = values.delete === true;
    if (remove === (values.fence !== undefined)) throw new CliError('give exactly one of --fence F and --delete', 2);
    let fence: bigint | null = null;
    if (!remove) {
      const text = String(values.fence);
      if (!/^[1-9][0-9]{0,18}$/.test(text) || BigInt(text) > 9223372036854775807n) {
        throw new CliError('--fence must be a positive 64-bit integer', 2);
      }
      fence = BigInt(text);
    }
    const url = requireDatabaseUrl(io, 'palisade locks reset-register changes palisade.lock_registers');
    const sql = await connect(url);
    try {
      const [kind, source, namespace, name] = key;
      let before: string | null;
      try {
        // One statement: the old value and the change, under the row's lock.
        const rows = await sql`with old as (select fence from palisade.lock_registers
            where kind = ${kind} and source = ${source} and namespace = ${namespace} and name = ${name} for update),
          gone as (delete from palisade.lock_registers where ${remove}::boolean
            and kind = ${kind} and source = ${source} and namespace = ${namespace} and name = ${name}),
          set as (insert into palisade.lock_registers (kind, source, namespace, name, fence)
            select ${kind}, ${source}, ${namespace}, ${name}, ${fence === null ? null : fence.toString()}::int8
            where not ${remove}::boolean
            on conflict (kind, source, namespace, name) do update set fence = excluded.fence)
          select (select fence::text from old) as before`;
        before = rows[0]?.before === null || rows[0]?.before === undefined ? null : String(rows[0].before);
      } catch (err) {
        if (missingTable(err)) throw new CliError(NO_TABLE);
        throw connectionError(err, url);
      }
      const after = fence === null ? null : fence.toString();
      if (values.json) io.out(toJson({ kind, source, namespace, name, before, after }));
      else io.out(`register ${kind} ${source} ${namespace} ${name}: ${before ?? '(none)'} -> ${after ?? '(deleted)'}`);
      return 0;
    } finally {
      await sql.end({ timeout: 5 });
    }
  },
};
