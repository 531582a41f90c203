/**
 * Counting Redis commands two ways, on the run's own server:
 *
 * - `INFO commandstats` deltas: every command the server executed, the ones
 *   a Lua script runs with `redis.call` included (Redis counts those too),
 *   and the server time spent in each;
 * - a MONITOR connection: only commands that arrived from a client (source
 *   is an address, not `lua`), i.e. round trips.
 *
 * MONITOR slows the server down (it copies every command, script-internal
 * ones too, to the monitor), so time is taken in a pass without it.
 * The benchmark's own `INFO` reads are subtracted; palisade's grant script
 * also calls INFO, and those calls are kept.
 */
import type { Redis } from 'ioredis';
import type { BenchRedis } from './services.js';

export interface CommandCount {
  /** Commands that clients sent (round trips), by name; empty without `monitor`. */
  readonly sent: Map<string, number>;
  readonly sentTotal: number;
  /** Every command executed, script-internal ones included, by name. */
  readonly executed: Map<string, number>;
  readonly executedTotal: number;
  /** Server time by command name (µs; a script's time includes the commands it runs). */
  readonly micros: Map<string, number>;
}

async function stats(admin: Redis): Promise<Map<string, { calls: number; usec: number }>> {
  const text = await admin.info('commandstats');
  const m = new Map<string, { calls: number; usec: number }>();
  for (const x of text.matchAll(/^cmdstat_([^:]+):calls=(\d+),usec=(\d+)/gm)) {
    m.set(x[1] as string, { calls: Number(x[2]), usec: Number(x[3]) });
  }
  return m;
}

/** Counts what `body` makes Redis do. Use on the run's own server only (MONITOR sees every client). */
export async function countCommands(
  redis: BenchRedis,
  body: () => Promise<void>,
  opts: { monitor: boolean },
): Promise<CommandCount> {
  const admin = redis.client();
  const sent = new Map<string, number>();
  let sentTotal = 0;
  let monitorClient: Redis | undefined;
  let monitor: Redis | undefined;
  if (opts.monitor) {
    monitorClient = redis.client();
    monitor = (await monitorClient.monitor()) as unknown as Redis;
    monitor.on('monitor', (_time: string, args: string[], source: string) => {
      if (source === 'lua') return;
      const name = String(args[0] ?? '').toLowerCase();
      if (name === 'info' || name === 'monitor') return; // the benchmark's own reads
      sentTotal++;
      sent.set(name, (sent.get(name) ?? 0) + 1);
    });
    // Let MONITOR start before the first counted command.
    await new Promise((r) => setTimeout(r, 50));
  }
  const before = await stats(admin);
  await body();
  const after = await stats(admin);
  if (monitor) {
    await new Promise((r) => setTimeout(r, 100)); // the MONITOR feed lags a little
    monitor.disconnect();
    monitorClient?.disconnect();
  }
  admin.disconnect();
  const executed = new Map<string, number>();
  const micros = new Map<string, number>();
  for (const [cmd, a] of after) {
    if (cmd === 'monitor' || cmd.startsWith('client') || cmd === 'hello' || cmd.startsWith('config')) continue;
    const b = before.get(cmd) ?? { calls: 0, usec: 0 };
    let d = a.calls - b.calls;
    if (cmd === 'info') d -= 1; // our `before` read (a read does not count itself)
    if (d > 0) executed.set(cmd, d);
    if (a.usec > b.usec) micros.set(cmd, a.usec - b.usec);
  }
  let executedTotal = 0;
  for (const d of executed.values()) executedTotal += d;
  return { sent, sentTotal, executed, executedTotal, micros };
}

/** Server µs spent in the commands named in `sent` (e.g. evalsha for a script lock, set for SET NX). */
export function serverMicros(count: CommandCount, sent: Map<string, number>): number {
  let us = 0;
  for (const name of sent.keys()) us += count.micros.get(name) ?? 0;
  return us;
}

/** `evalsha 1.00, set 1.00` — per-operation counts, largest first. */
export function perOp(counts: Map<string, number>, n: number): string {
  return [...counts.entries()]
    .sort((a, b) => b[1] - a[1])
    .map(([k, v]) => `${k} ${(v / n).toFixed(2)}`)
    .join(', ');
}
