/**
 * `palisade fence-trigger`: prints the SQL of the fence trigger for a
 * drizzle-kit custom migration (`drizzle-kit generate --custom`).
 */
import { CliError, InvalidArgumentError } from '../errors.js';
import { fenceTriggerSql } from '../schema/fence-trigger.js';
import { type Command, parse } from './common.js';

const help = `Usage: palisade fence-trigger TABLE [--schema NAME] [--same-fence reject|allow] [--allow-deletes]

Prints the SQL that installs palisade's fence trigger on TABLE: Postgres then
refuses every UPDATE that does not raise last_fence, and every DELETE of a live
row (palisade deletes leave tombstones), from any client — psql, other services.
TABLE must already have palisade's fence columns (spread fenceColumns()).
Names with control characters (newlines…) are refused (exit code 2).

Typical use, after adding fenceColumns() to the table and generating (the
output starts with a statement breakpoint, so several tables can be appended
to one file):
  npx drizzle-kit generate --custom --name fence_trigger_TABLE
  npx palisade fence-trigger TABLE >> "$(ls drizzle/*_fence_trigger_TABLE.sql)"
  npx palisade migrate --migrations-folder drizzle

Options:
  --schema NAME              the table's schema (default: the search_path's)
  --same-fence reject|allow  allow: accept an update that keeps last_fence equal
                             (for repositories with sameFence: 'allow'); default reject
  --allow-deletes            do not guard DELETE
  -h, --help                 this help`;

export const fenceTriggerCommand: Command = {
  summary: 'print the SQL of a trigger that fences out writers bypassing palisade',
  help,
  async run(argv, io) {
    const { values, positionals } = parse(
      'fence-trigger',
      argv,
      {
        schema: { type: 'string' },
        'same-fence': { type: 'string' },
        'allow-deletes': { type: 'boolean' },
      },
      true,
    );
    if (values.help) {
      io.out(help);
      return 0;
    }
    if (positionals.length !== 1) throw new CliError('name exactly one table (see: palisade fence-trigger --help)', 2);
    const sameFence = values['same-fence'] ?? 'reject';
    if (sameFence !== 'reject' && sameFence !== 'allow') throw new CliError('--same-fence must be reject or allow', 2);
    const name = String(positionals[0]);
    if (name.length === 0) throw new CliError('the table name is empty', 2);
    const schema = values.schema === undefined ? undefined : String(values.schema);
    // An empty --schema would silently mean the search_path's: say so instead.
    if (schema === '') throw new CliError('--schema is empty (leave it out for the search_path schema)', 2);
    let text: string;
    try {
      // Built (and the names checked) before anything is printed: the names also go into the comment line below.
      text = fenceTriggerSql(
        { name, ...(schema === undefined ? {} : { schema }) },
        { sameFence, guardDeletes: values['allow-deletes'] !== true },
      );
    } catch (err) {
      if (err instanceof InvalidArgumentError) throw new CliError(err.message, 2);
      throw err;
    }
    // A leading newline (drizzle-kit's custom file ends in a comment without one) and a statement
    // breakpoint, so the output can be appended for several tables: each block starts a statement.
    io.out(
      `\n--> statement-breakpoint\n-- palisade fence trigger on ${schema === undefined ? '' : `${schema}.`}${name}\n${text}`,
    );
    return 0;
  },
};
