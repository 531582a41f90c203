/**
 * How the Redis backend's Lua scripts are declared and run: each script file
 * declares its Lua with the typed function that calls it; the backend
 * defines them all on the caller's client (`defineCommand`, which falls back
 * from EVALSHA to EVAL after a NOSCRIPT) and runs them under the command
 * deadline.
 */
import type { Bounded } from '../command-deadline.js';
import type { RedisClient } from '../options.js';

/** @internal One script: its command name (versioned: a changed script gets a new name), Lua and key count. */
export interface LuaScript {
  readonly name: string;
  readonly lua: string;
  readonly numberOfKeys: number;
  readonly readOnly?: boolean;
}

/** @internal Runs a defined script with its keys, then its arguments. */
export type RunScript = (script: LuaScript, args: (string | number)[]) => Promise<unknown>;

/** @internal Defines `scripts` on `client` and returns how to run them, each bounded by `bounded`. */
export function scriptRunner(client: RedisClient, scripts: readonly LuaScript[], bounded: Bounded): RunScript {
  for (const { name, lua, numberOfKeys, readOnly } of scripts) {
    client.defineCommand(name, { lua, numberOfKeys, readOnly });
  }
  const commands = client as unknown as Record<string, (...args: (string | number)[]) => Promise<unknown>>;
  return (script, args) =>
    bounded(`Redis script ${script.name}`, () => (commands[script.name] as (typeof commands)[string])(...args));
}
