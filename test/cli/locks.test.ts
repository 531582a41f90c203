/**
 * `palisade locks`: who holds what in the Postgres lease table — name,
 * holder, fence, age, TTL left — as a table or as JSON.
 */
import { sql } from 'drizzle-orm';
import postgres from 'postgres';
import { afterEach, describe, expect, it } from 'vitest';
import { execute } from '../../src/driver.js';
import { postgresLockManager } from '../../src/fencing/backends/postgres-lease/backend.js';
import { toFence } from '../../src/fencing/fence.js';
import { migrate } from '../../src/migrate.js';
import { claimLockRegister } from '../../src/repo/register-claim.js';
import { killAllCli, runCli } from '../support/cli.js';
import { postgresDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { sleep } from '../support/sleep.js';

afterEach(killAllCli);

interface Row {
  namespace: string;
  name: string;
  holder: string | null;
  fence: string;
  ageMs: number;
  remainingMs: number;
  expired: boolean;
}

describe.runIf(needs('DATABASE_URL'))('palisade locks (real Postgres)', { timeout: 120_000 }, () => {
  it('lists live leases with holder, fence, age and TTL left; filters; JSON and table', async () => {
    const test = await postgresDatabase();
    const nsA = uniqueNamespace('billing');
    const nsB = uniqueNamespace('search');
    const a = postgresLockManager({ client: test.db, namespace: nsA, listen: false });
    const b = postgresLockManager({ client: test.db, namespace: nsB, listen: false });
    try {
      await migrate(test.db);
      const env = { DATABASE_URL: test.url };
      const report = await a.acquire('report:nightly', { ttlMs: 60_000, holder: 'host-1 pid 7' });
      const invoice = await a.acquire('invoice:42', { ttlMs: 60_000 });
      const rebuild = await b.acquire('rebuild', { ttlMs: 60_000, holder: 'admin' });
      const gone = await a.acquire('released', { ttlMs: 60_000 });
      await gone.release();
      await a.acquire('short', { ttlMs: 50 });
      // Bounded: until the database says the short lease expired (at most 100 × 50 ms).
      for (let i = 0; i < 100 && (await a.inspect('short')) !== null; i++) await new Promise((r) => setTimeout(r, 50));
      expect(await a.inspect('short')).toBeNull();

      const all = await runCli(['locks', '--json'], env);
      expect(all.code).toBe(0);
      const rows = JSON.parse(all.stdout) as Row[];
      expect(rows.map((r) => [r.namespace, r.name, r.holder, r.fence, r.expired])).toEqual([
        [nsA, 'invoice:42', null, String(invoice.fence), false],
        [nsA, 'report:nightly', 'host-1 pid 7', String(report.fence), false],
        [nsB, 'rebuild', 'admin', String(rebuild.fence), false],
      ]);
      for (const r of rows) {
        expect(r.remainingMs).toBeGreaterThan(0);
        expect(r.remainingMs).toBeLessThanOrEqual(60_000);
        expect(r.ageMs).toBeGreaterThanOrEqual(0);
      }

      const onlyB = JSON.parse((await runCli(['locks', '--namespace', nsB, '--json'], env)).stdout) as Row[];
      expect(onlyB.map((r) => r.name)).toEqual(['rebuild']);

      const withExpired = JSON.parse(
        (await runCli(['locks', '--namespace', nsA, '--expired', '--json'], env)).stdout,
      ) as Row[];
      expect(withExpired.map((r) => [r.name, r.expired])).toEqual([
        ['invoice:42', false],
        ['report:nightly', false],
        ['short', true],
      ]);
      expect(withExpired.find((r) => r.name === 'short')?.remainingMs).toBeLessThanOrEqual(0);

      const human = await runCli(['locks', '--namespace', nsA], env);
      expect(human.code).toBe(0);
      const lines = human.stdout.trim().split('\n');
      expect(lines[0]).toMatch(/^NAMESPACE\s+NAME\s+HOLDER\s+FENCE\s+AGE\s+TTL LEFT$/);
      expect(lines[2]).toMatch(
        new RegExp(`^${nsA}\\s+report:nightly\\s+host-1 pid 7\\s+${report.fence}\\s+\\S+\\s+\\d`),
      );
      expect(lines).toHaveLength(3);

      const limited = await runCli(['locks', '--limit', '1'], env);
      expect(limited.stdout.trim().split('\n')).toHaveLength(2);
      expect(limited.stderr).toMatch(/showing the first 1/);

      const none = await runCli(['locks', '--namespace', 'nobody-here'], env);
      expect(none.stdout).toBe('no locks held in namespace nobody-here\n');
      await Promise.all([report.release(), invoice.release(), rebuild.release()]);
    } finally {
      await a.close();
      await b.close();
      await test.close();
    }
  });

  it('says to migrate when the lease table is missing, in one line', async () => {
    const test = await postgresDatabase();
    try {
      const run = await runCli(['locks'], { DATABASE_URL: test.url });
      expect(run.code).toBe(1);
      expect(run.stderr).toBe(
        'palisade locks: no palisade.leases table in this database: run `palisade migrate` first\n',
      );
    } finally {
      await test.close();
    }
  });
});

describe.runIf(needs('DATABASE_URL'))('palisade locks reset-register (real Postgres)', { timeout: 120_000 }, () => {
  it('changes nothing on a register that does not exist, one that moved from --expect, or one locked past --wait-ms', async () => {
    const test = await postgresDatabase({ migrated: true });
    const held = postgres(test.url as string, { max: 1, onnotice: () => {} });
    try {
      const env = { DATABASE_URL: test.url };
      const namespace = uniqueNamespace('reset');
      const forged = '4611686018427387904';
      const nfc = 'caf\u00e9';
      await test.db.execute(sql`insert into palisade.lock_registers (kind, source, namespace, name, fence)
        values ('redis', 'src', ${namespace}, ${nfc}, ${forged}::int8)`);
      const fenceOf = async (name: string) => {
        const [row] = await execute(
          test.db,
          sql`select fence::text as fence from palisade.lock_registers
            where kind = 'redis' and source = 'src' and namespace = ${namespace} and name = ${name}`,
        );
        return row?.fence ?? null;
      };
      const reset = (name: string, ...more: string[]) =>
        runCli(
          ['locks', 'reset-register', '--kind', 'redis', '--source', 'src', '--namespace', namespace, '--name', name]
            .concat(more)
            .concat('--json'),
          env,
        );
      // The decomposed spelling of the name is another register, which does not exist: refused, nothing made.
      const nfd = nfc.normalize('NFD');
      const typo = await reset(nfd, '--fence', '5');
      expect([typo.code, typo.stderr]).toEqual([1, expect.stringMatching(/no such register, nothing changed/)]);
      expect(typo.stderr).not.toContain(nfd);
      expect([await fenceOf(nfd), await fenceOf(nfc)]).toEqual([null, forged]);
      expect((await reset(nfd, '--delete')).code).toBe(1);
      // Moved since the operator looked: refused.
      const moved = await reset(nfc, '--fence', '5', '--expect', '6');
      expect([moved.code, moved.stderr]).toEqual([1, expect.stringMatching(/no longer holds the --expect fence/)]);
      expect(await fenceOf(nfc)).toBe(forged);
      // A transaction that keeps the register's row locked (a paused holder's claim): refused once --wait-ms is up.
      await held.begin(async (tx) => {
        await tx`select 1 from palisade.lock_registers where namespace = ${namespace} for share`;
        const locked = await reset(nfc, '--fence', '5', '--wait-ms', '200');
        expect([locked.code, locked.stderr]).toEqual([1, expect.stringMatching(/kept the register's row locked/)]);
      });
      expect(await fenceOf(nfc)).toBe(forged);
      // What the operator saw, then: reset.
      const done = await reset(nfc, '--fence', '5', '--expect', forged);
      expect([done.code, JSON.parse(done.stdout)]).toEqual([
        0,
        expect.objectContaining({ before: forged, after: '5' }),
      ]);
      expect(await fenceOf(nfc)).toBe('5');
      // --create makes a register that does not exist; --delete removes one.
      const made = await reset('new', '--fence', '9', '--create');
      expect([made.code, JSON.parse(made.stdout)]).toEqual([0, expect.objectContaining({ before: null, after: '9' })]);
      expect((await reset('new', '--delete')).code).toBe(0);
      expect(await fenceOf('new')).toBeNull();
      const usage = await Promise.all([
        reset(nfc, '--delete', '--create'),
        reset(nfc, '--fence', '5', '--expect', '0'),
        reset(nfc, '--fence', '5', '--wait-ms', '0'),
        reset(nfc, '--fence', '9223372036854775808'),
        reset(nfc, '--fence', '05'),
        // Past Postgres' lock_timeout (an int4 of ms): a usage error, not the server's, which quoted the value.
        reset(nfc, '--fence', '5', '--wait-ms', '2147483648'),
        // A register no lock-scoped write could ever claim is not made.
        reset('n'.repeat(1025), '--fence', '5', '--create'),
      ]);
      expect(usage.map((u) => u.code)).toEqual([2, 2, 2, 2, 2, 2, 2]);
      expect(usage[6]?.stderr).toMatch(/lock\.name must be at most 1024 UTF-8 bytes/);
      expect(await fenceOf('n'.repeat(1025))).toBeNull();
      expect(usage[3]?.stderr).toMatch(/--fence must be a positive 64-bit integer/);
      expect(usage[5]?.stderr).toBe('palisade locks: --wait-ms must be an integer in 1 … 2147483647\n');
      expect(await fenceOf(nfc)).toBe('5');
    } finally {
      await held.end({ timeout: 1 });
      await test.close();
    }
  });
});

describe.runIf(needs('DATABASE_URL'))(
  'palisade locks reset-register --create racing a claim',
  { timeout: 120_000 },
  () => {
    it("leaves a register a claim made while it ran: the claim's fence keeps refusing lower fences of the lock", async () => {
      const test = await postgresDatabase({ migrated: true });
      const claimer = postgres(test.url as string, { max: 1, onnotice: () => {} });
      try {
        const namespace = uniqueNamespace('create');
        const lock = { kind: 'redis', source: 'src', namespace, name: 'L' };
        let cli: Promise<Awaited<ReturnType<typeof runCli>>> | undefined;
        // A newer holder's first claim inserts the register (fence 20); its transaction has not committed when
        // the operator, who believes 10 is the latest fence, creates the register.
        await claimer.begin(async (tx) => {
          await tx`select palisade.claim_lock('redis', 'src', ${namespace}, 'L', 20)`;
          cli = runCli(
            [
              'locks',
              'reset-register',
              '--kind',
              'redis',
              '--source',
              'src',
              '--namespace',
              namespace,
              '--name',
              'L',
            ].concat(['--fence', '10', '--create', '--wait-ms', '60000']),
            { DATABASE_URL: test.url },
          );
          // Committed once the CLI waits for the claim's row (bounded: the CLI's own wait is 60 s).
          for (let i = 0; i < 600; i++) {
            // From another session: this transaction would see the one snapshot of pg_stat_activity it took first.
            const [row] = await execute(
              test.db,
              sql`select count(*)::int as n from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'`,
            );
            if (row?.n === 1) break;
            await sleep(50);
          }
        });
        const run = await (cli as Promise<Awaited<ReturnType<typeof runCli>>>);
        expect([run.code, run.stderr]).toEqual([1, expect.stringMatching(/the register was made meanwhile/)]);
        const [row] = await execute(
          test.db,
          sql`select fence::text as fence from palisade.lock_registers where namespace = ${namespace}`,
        );
        expect(row?.fence).toBe('20');
        // The holder the claim fenced out stays out.
        const old = { fence: toFence(10n), signal: new AbortController().signal, lock };
        expect(await claimLockRegister(test.db, old)).toEqual({ status: 'stale', currentFence: 20n });
      } finally {
        await claimer.end({ timeout: 1 });
        await test.close();
      }
    });
  },
);

describe.runIf(needs('DATABASE_URL'))('palisade locks registers (real Postgres)', { timeout: 120_000 }, () => {
  it("lists one line per register: a name's line break or terminal control is escaped, columns stay aligned", async () => {
    const test = await postgresDatabase({ migrated: true });
    try {
      const namespace = uniqueNamespace('names');
      const names = ['x\nredis  src  billing  forged  1', 'cafe\u0301', '\u001b[31mred', 'back\\slash'];
      for (const name of names) {
        await execute(
          test.db,
          sql`insert into palisade.lock_registers (kind, source, namespace, name, fence) values ('redis', 'src', ${namespace}, ${name}, 7)`,
        );
      }
      const listed = await runCli(['locks', 'registers', '--namespace', namespace], { DATABASE_URL: test.url });
      expect(listed.code).toBe(0);
      const lines = listed.stdout.trimEnd().split('\n');
      expect(lines[0]).toMatch(/^KIND\s+SOURCE\s+NAMESPACE\s+NAME\s+FENCE$/);
      // (In the database's collation order, which may differ.)
      expect(
        lines
          .slice(1)
          .map((l) => l.replace(/\s+/g, ' '))
          .sort(),
      ).toEqual(
        [
          `redis src ${namespace} back\\\\slash 7`,
          `redis src ${namespace} cafe\u0301 7`,
          `redis src ${namespace} x\\nredis src billing forged 1 7`,
          `redis src ${namespace} \\u001b[31mred 7`,
        ].sort(),
      );
      // Every FENCE starts in the header's column, the combining mark counted as no column.
      const at = (lines[0] as string).indexOf('FENCE');
      for (const line of lines.slice(1))
        expect([line, [...line.normalize('NFC')].lastIndexOf('7')]).toEqual([line, at]);
      // JSON keeps the names as they are.
      const json = await runCli(['locks', 'registers', '--namespace', namespace, '--json'], { DATABASE_URL: test.url });
      expect((JSON.parse(json.stdout) as { name: string }[]).map((r) => r.name).sort()).toEqual([...names].sort());
    } finally {
      await test.close();
    }
  });
});

describe('palisade locks: usage', () => {
  it('needs DATABASE_URL and a positive --limit', async () => {
    const noUrl = await runCli(['locks'], { DATABASE_URL: undefined });
    expect(noUrl.code).toBe(1);
    expect(noUrl.stderr).toMatch(/^palisade locks: DATABASE_URL is not set/);
    const badLimit = await runCli(['locks', '--limit', '0'], { DATABASE_URL: 'postgres://127.0.0.1:1/x' });
    expect(badLimit.code).toBe(2);
    expect(badLimit.stderr).toBe('palisade locks: --limit must be a positive integer\n');
    const refused = await runCli(['locks'], { DATABASE_URL: 'postgres://u:secret@127.0.0.1:1/x' });
    expect(refused.code).toBe(1);
    expect(refused.stderr).toMatch(/^palisade locks: cannot connect to 127\.0\.0\.1:1\/x: /);
    expect(refused.stderr).not.toContain('secret');
  });
});
