/**
 * `palisade locks registers` and `palisade locks reset-register`: the lock
 * registers of lock-scoped fencing (README, "Two scopes of fencing",
 * "Resetting a register").
 */
import { CliError, InvalidArgumentError } from '../errors.js';
import { toFence } from '../fencing/fence.js';
import { checkLockIdentity } from '../fencing/lock-identity.js';
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
       [--expect E] [--create] [--wait-ms MS]

Sets one lock register to fence F, or deletes it. Use it only when a register
holds a fence that was never granted (a forged or miscomputed number) and so
refuses every lock-scoped write of that lock: set it to the highest fence the
lock's backend has really granted (its current holder's fence). Setting it
lower than a fence a live or paused holder carries lets that holder's late
writes land again; deleting it does the same for every fence of the lock.
Prints the register's fence before and after. Changes nothing, and exits 1,
when the register does not exist (kind, source, namespace and name match byte
for byte; the built-in lock managers store names in Unicode NFC), when it no
longer holds E, or when a transaction keeps its row locked past MS.

Options:
  --kind K        backend kind: postgres, advisory, redis, etcd, …
  --source S      fence source id (see palisade locks registers)
  --namespace NS  lock-manager namespace
  --name N        lock name
  --fence F       the fence to set (a positive integer)
  --delete        delete the register instead
  --expect E      change it only if it holds fence E (what palisade locks registers showed)
  --create        with --fence: create the register if it does not exist (one a claim made meanwhile: left alone)
  --wait-ms MS    wait at most MS (up to 2147483647) for a transaction that holds the register's row (default 5000)
  --json          JSON on stdout
  -h, --help      this help

Environment:
  DATABASE_URL    the Postgres that holds the fenced tables (required)`;

const missingTable = (err: unknown) => (err as { code?: unknown }).code === '42P01';
const MISSING =
  'no such register, nothing changed: kind, source, namespace and name match byte for byte (the built-in lock managers store names in Unicode NFC); `palisade locks registers` lists them, and --create makes a new one';
const MOVED =
  'the register no longer holds the --expect fence (a claim or another reset moved it), nothing changed: look again with `palisade locks registers`';
const CREATED =
  'the register was made meanwhile (a lock-scoped write or a grant claimed it), nothing changed: look again with `palisade locks registers`';
const LOCKED =
  "a transaction kept the register's row locked past --wait-ms (a holder's fenced transaction or lock-scoped write), nothing changed: try again, or wait longer";

/** The longest --wait-ms: Postgres' `lock_timeout` is an int4 of milliseconds. */
const MAX_WAIT_MS = 2_147_483_647;

/** A fence option (as {@link toFence} reads a decimal string), or a usage error naming it. */
function fenceArg(option: string, value: unknown): bigint {
  try {
    return toFence(String(value));
  } catch {
    throw new CliError(`${option} must be a positive 64-bit integer`, 2);
  }
}
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
      expect: { type: 'string' },
      create: { type: 'boolean' },
      'wait-ms': { type: 'string' },
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
    const fence = remove ? null : fenceArg('--fence', values.fence);
    const expected = values.expect === undefined ? null : fenceArg('--expect', values.expect).toString();
    const create = values.create === true;
    if (create && remove) throw new CliError('--create goes with --fence, not --delete', 2);
    // A register no lock-scoped write could ever claim (a part over 1,024 bytes, NUL, a lone surrogate) is not made.
    if (create) {
      try {
        checkLockIdentity({ kind: key[0], source: key[1], namespace: key[2], name: key[3] });
      } catch (err) {
        if (err instanceof InvalidArgumentError) throw new CliError(err.message, 2);
        throw err;
      }
    }
    const waitMs = values['wait-ms'] === undefined ? 5000 : Number(values['wait-ms']);
    // Postgres' own bound on lock_timeout (ms, int4).
    if (!Number.isSafeInteger(waitMs) || waitMs < 1 || waitMs > MAX_WAIT_MS)
      throw new CliError(`--wait-ms must be an integer in 1 … ${MAX_WAIT_MS}`, 2);
    const url = requireDatabaseUrl(io, 'palisade locks reset-register changes palisade.lock_registers');
    const sql = await connect(url);
    try {
      const [kind, source, namespace, name] = key;
      let outcome: { before: string | null; refused?: string };
      try {
        // The old value and the change in one transaction, under the row's lock, waiting for it only so long.
        outcome = await sql.begin(async (tx) => {
          await tx`select set_config('lock_timeout', ${String(waitMs)}, true)`;
          const [row] = await tx`select fence::text as fence from palisade.lock_registers
            where kind = ${kind} and source = ${source} and namespace = ${namespace} and name = ${name} for update`;
          const before = row === undefined ? null : String(row.fence);
          if (before === null && !create) return { before, refused: MISSING };
          if (expected !== null && before !== expected) return { before, refused: MOVED };
          if (remove) {
            await tx`delete from palisade.lock_registers
              where kind = ${kind} and source = ${source} and namespace = ${namespace} and name = ${name}`;
          } else if (before === null) {
            // Missing when read, which locks nothing: a claim may insert the row meanwhile (its transaction not yet
            // committed when read). Made only if still missing — overwriting that claim would let back in the
            // holders its fence fenced out.
            const made = await tx`insert into palisade.lock_registers (kind, source, namespace, name, fence)
              values (${kind}, ${source}, ${namespace}, ${name}, ${String(fence)}::int8)
              on conflict (kind, source, namespace, name) do nothing returning 1`;
            if (made.length === 0) return { before, refused: CREATED };
          } else {
            await tx`update palisade.lock_registers set fence = ${String(fence)}::int8
              where kind = ${kind} and source = ${source} and namespace = ${namespace} and name = ${name}`;
          }
          return { before };
        });
      } catch (err) {
        if (missingTable(err)) throw new CliError(NO_TABLE);
        if ((err as { code?: unknown }).code === '55P03') throw new CliError(LOCKED);
        throw connectionError(err, url);
      }
      const { before, refused } = outcome;
      if (refused !== undefined) throw new CliError(refused);
      const after = fence === null ? null : fence.toString();
      if (values.json) io.out(toJson({ kind, source, namespace, name, before, after }));
      else io.out(`register ${kind} ${source} ${namespace} ${name}: ${before ?? '(none)'} -> ${after ?? '(deleted)'}`);
      return 0;
    } finally {
      await sql.end({ timeout: 5 });
    }
  },
};
