/**
 * How the Redis backend's Lua scripts are declared and run: each script file
 * declares its Lua with the typed function that calls it; the backend runs
 * them by SHA-1 (`EVALSHA`), sending the whole script (`EVAL`, which also
 * loads it) only when the server answers NOSCRIPT — after a restart, a
 * failover or a `SCRIPT FLUSH` — and every call under the command deadline.
 */
import { createHash } from 'node:crypto';
import type { Bounded } from '../command-deadline.js';
import type { RedisClient } from '../options.js';

/** @internal One script: its name (versioned: a changed script gets a new name, for messages), Lua and key count. */
export interface LuaScript {
  readonly name: string;
  readonly lua: string;
  readonly numberOfKeys: number;
}

/** @internal Runs a script with its keys, then its arguments. */
export type RunScript = (script: LuaScript, args: (string | number)[]) => Promise<unknown>;

// ioredis flattens an array argument (`args.flat()`): the arguments go as one array, not spread.
type Eval = (script: string, keys: number, args: (string | number)[]) => Promise<unknown>;

/**
 * @internal How to run `scripts` on `client`, each call bounded by `bounded`.
 * Called directly rather than through ioredis's `defineCommand`, whose
 * wrapper costs a closure, a second promise and a per-socket lookup on every
 * call — and its first call on each connection sends the whole script.
 */
export function scriptRunner(client: RedisClient, scripts: readonly LuaScript[], bounded: Bounded): RunScript {
  const shas = new Map(scripts.map((s) => [s, createHash('sha1').update(s.lua).digest('hex')]));
  const evalsha = (client.evalsha as Eval).bind(client);
  const evalFull = (client.eval as Eval).bind(client);
  const run = async (script: LuaScript, args: (string | number)[], expired: () => boolean) => {
    try {
      return await evalsha(shas.get(script) as string, script.numberOfKeys, args);
    } catch (err) {
      if (!(err instanceof Error) || !err.message.startsWith('NOSCRIPT')) throw err;
      // Not once the call timed out: the caller may have sent a give-back since (a release of a grant's
      // token), which this script, sent after it, would overtake — and take a lock nobody holds.
      if (expired()) throw err;
      return evalFull(script.lua, script.numberOfKeys, args);
    }
  };
  return (script, args) => bounded(`Redis script ${script.name}`, (expired) => run(script, args, expired));
}
