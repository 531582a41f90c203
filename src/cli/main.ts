#!/usr/bin/env node
/**
 * The `palisade` command. Each subcommand lives in its own file; this one
 * dispatches, prints help, and turns any failure into one line on stderr
 * and a non-zero exit code (1: failed, 2: bad usage). Nothing imports it.
 */
import { readFileSync } from 'node:fs';
import { CliError, PalisadeError } from '../errors.js';
import type { Command, Io } from './common.js';
import { demoCommand } from './demo.js';
import { fenceTriggerCommand } from './fence-trigger.js';
import { locksCommand } from './locks.js';
import { migrateCommand } from './migrate.js';

const commands: Record<string, Command> = {
  demo: demoCommand,
  migrate: migrateCommand,
  locks: locksCommand,
  'fence-trigger': fenceTriggerCommand,
};

function version(): string {
  try {
    const pkg = JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as {
      version?: string;
    };
    return pkg.version ?? 'unknown';
  } catch {
    return 'unknown';
  }
}

function usage(): string {
  const width = Math.max(...Object.keys(commands).map((c) => c.length));
  return `Usage: palisade <command> [options]

palisade ${version()} — fencing-aware data access on Postgres: a stale lock holder's write never lands.

Commands:
${Object.entries(commands)
  .map(([name, c]) => `  ${name.padEnd(width)}  ${c.summary}`)
  .join('\n')}

Run "palisade <command> --help" for a command's options.
Start with: palisade demo   (no database server needed)`;
}

async function main(argv: string[], io: Io): Promise<number> {
  const [name, ...rest] = argv;
  if (name === undefined || name === '--help' || name === '-h' || name === 'help') {
    const topic = name === 'help' ? rest[0] : undefined;
    if (topic && commands[topic]) io.out(commands[topic].help);
    else io.out(usage());
    return name === undefined ? 2 : 0;
  }
  if (name === '--version' || name === '-v') {
    io.out(version());
    return 0;
  }
  const command = commands[name];
  if (!command)
    throw new CliError(
      `unknown command "${name}" (commands: ${Object.keys(commands).join(', ')}; see: palisade --help)`,
      2,
    );
  return command.run(rest, io);
}

const io: Io = {
  out: (text) => process.stdout.write(`${text}\n`),
  err: (text) => process.stderr.write(`${text}\n`),
  env: process.env,
};

const prefix = (() => {
  const name = process.argv[2];
  return name && Object.hasOwn(commands, name) ? `palisade ${name}` : 'palisade';
})();

try {
  process.exitCode = await main(process.argv.slice(2), io);
} catch (err) {
  const message = err instanceof Error ? err.message : String(err);
  const oneLine = message.replace(/\s*\n\s*/g, ' ').trim();
  // A CliError's message is the whole story; other palisade errors name their code.
  const code = err instanceof PalisadeError && !(err instanceof CliError) ? ` [${err.code}]` : '';
  process.stderr.write(`${prefix}: ${oneLine}${code}\n`);
  if (process.env.PALISADE_DEBUG && err instanceof Error && err.stack) process.stderr.write(`${err.stack}\n`);
  process.exitCode = err instanceof CliError ? err.exitCode : 1;
}
