/**
 * Runs one example job in its own OS process for the example tests. Every
 * event the job reports is printed as a JSON line (`{ event: 'example', … }`);
 * at the event named by `holdAt` the job is held — its event handler waits
 * for a `{"cmd":"go"}` line on stdin — so the parent can SIGSTOP or SIGKILL
 * it at exactly that point. Ends with `{ event: 'result', … }`.
 * argv[2]: JSON { example, databaseUrl, namespace, options, holdAt? }.
 */
import { createInterface } from 'node:readline';
import { connect } from '../../examples/shared.js';
import { advisoryLockManager, postgresLockManager } from '../../src/index.js';

interface Args {
  example: 'billing-cron' | 'backfill' | 'search-index-rebuild' | 'nightly-report';
  databaseUrl: string;
  namespace: string;
  options: Record<string, unknown>;
  /** Hold the job at the first event of this type whose fields include these values. */
  holdAt?: { type: string } & Record<string, unknown>;
}

const args = JSON.parse(process.argv[2] ?? '{}') as Args;
const say = (event: string, data: Record<string, unknown> = {}) =>
  process.stdout.write(
    `${JSON.stringify({ event, pid: process.pid, ...data }, (_k, v) => (typeof v === 'bigint' ? v.toString() : v))}\n`,
  );

const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
let held = false;
async function onEvent(e: { type: string }): Promise<void> {
  say('example', e as Record<string, unknown>);
  const hold = args.holdAt;
  if (held || !hold) return;
  if (!Object.entries(hold).every(([k, v]) => (e as Record<string, unknown>)[k] === v)) return;
  held = true;
  say('holding', e as Record<string, unknown>);
  // Bounded by the parent's test timeout: it always sends go or kills us.
  for (;;) {
    const next = await lines.next();
    if (next.done) return;
    if ((JSON.parse(next.value) as { cmd?: string }).cmd === 'go') return;
  }
}

const { sql, db, close } = connect(args.databaseUrl, 4);
const locks =
  args.example === 'nightly-report'
    ? advisoryLockManager({ client: sql, namespace: args.namespace })
    : postgresLockManager({ client: db, namespace: args.namespace });
let result: unknown;
try {
  switch (args.example) {
    case 'billing-cron': {
      const { runBillingCron } = await import('../../examples/billing-cron/index.js');
      result = await runBillingCron({ db, locks, period: String(args.options.period), ...args.options, onEvent });
      break;
    }
    case 'nightly-report': {
      const { runNightlyReport } = await import('../../examples/nightly-report/index.js');
      result = await runNightlyReport({ db, locks, day: String(args.options.day), ...args.options, onEvent });
      break;
    }
    case 'search-index-rebuild': {
      const { rebuildSearchIndex } = await import('../../examples/search-index-rebuild/index.js');
      result = await rebuildSearchIndex({ db, locks, ...args.options, onEvent });
      break;
    }
    case 'backfill': {
      const { runBackfill } = await import('../../examples/backfill/index.js');
      result = await runBackfill({ db, locks, ...args.options, onEvent });
      break;
    }
    default:
      throw new Error(`example ${args.example} is not wired into the example worker`);
  }
  say('result', { result });
} catch (err) {
  say('error', { message: err instanceof Error ? err.message : String(err) });
} finally {
  await locks.close();
  await close();
}
process.exit(0);
