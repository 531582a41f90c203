/**
 * Counting Redis commands two ways, on the run's own server:
 *
 * - `INFO commandstats` deltas: every command the server executed, the ones
 *   a Lua script runs with `redis.call` included (Redis counts those too);
 * - a MONITOR connection: only commands that arrived from a client (source
 *   is an address, not `lua`), i.e. round trips.
 *
 * The benchmark's own `INFO` reads are subtracted; palisade's grant script
 * also calls INFO, and those calls are kept.
 */
import type { Redis } from 'ioredis';
import type { BenchRedis } from './services.js';

export interface CommandCount {
  /** Commands that clients sent (round trips; pipelined ones count each). */
  readonly clientCommands: number;
  /** Every command executed, script-internal ones included, by name. */
  readonly executed: Map<string, number>;
  readonly executedTotal: number;
  /** Client commands by name. */
  readonly sent: Map<string, number>;
}

/** Counts what `body` makes Redis do. Use on the run's own server only (MONITOR sees every client). */
export async function countCommands(redis: BenchRedis, body: () => Promise<void>): Promise<CommandCount> {
  const monitorClient = redis.client();
  const monitor = (await monitorClient.monitor()) as unknown as Redis;
  const sent = new Map<string, number>();
  let clientCommands = 0;
  monitor.on('monitor', (_time: string, args: string[], source: string) => {
    if (source === 'lua') return;
    const name = String(args[0] ?? '').toLowerCase();
    if (name === 'info' || name === 'monitor') return; // the benchmark's own reads
    clientCommands++;
    sent.set(name, (sent.get(name) ?? 0) + 1);
  });
  // Let MONITOR start before the first counted command.
  await new Promise((r) => setTimeout(r, 50));
  const before = await redis.commandStats();
  await body();
  const after = await redis.commandStats();
  await new Promise((r) => setTimeout(r, 100)); // the MONITOR feed lags a little
  monitor.disconnect();
  monitorClient.disconnect();
  const executed = new Map<string, number>();
  for (const [cmd, calls] of after) {
    let d = calls - (before.get(cmd) ?? 0);
    if (cmd === 'info') d -= 1; // our `before` read
    if (cmd === 'monitor' || cmd.startsWith('client') || cmd === 'hello' || cmd.startsWith('config')) continue;
    if (d > 0) executed.set(cmd, d);
  }
  let executedTotal = 0;
  for (const d of executed.values()) executedTotal += d;
  return { clientCommands, executed, executedTotal, sent };
}

/** `evalsha 1.00, set 1.00` — per-operation counts, largest first. */
export function perOp(counts: Map<string, number>, n: number): string {
  return [...counts.entries()]
    .sort((a, b) => b[1] - a[1])
    .map(([k, v]) => `${k} ${(v / n).toFixed(2)}`)
    .join(', ');
}
