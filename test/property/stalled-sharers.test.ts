/**
 * Which sessions a raise of a lock register ends (migrations 0009 and 0010;
 * README, "Known limits"), searched on a REAL Postgres. Each case opens a
 * few sessions, each tagged as palisade tags a sharer (the client's
 * `registerTag`) of one lock or another at a fence around the register's,
 * sharing the register row or not, in this database or another one; each
 * is then left idle in its transaction, busy in a statement, or stalled
 * mid-statement the ways a paused holder or a link stalls one: a COPY
 * waiting for its data, a statement whose answers a proxy withholds
 * (postgres.js), a Parse whose Bind a proxy holds back (node-postgres), a
 * large result the proxy stops reading. Then one raise: by
 * `end_stalled_sharers` itself, by a claim (`claim_lock`, a Redis lock) or
 * by a grant (`register_grant`, a Postgres lease), maybe while another
 * transaction holds an uncommitted raise of the register.
 *
 * The model: a raise above the register's committed fence R ends exactly
 * the sessions of this database tagged as sharers of that lock at R that
 * wait for their client mid-statement (ClientRead, ClientWrite); nobody when
 * it is not above R, nor while another transaction holds the row (that
 * raise may be the newest holder's). A claim or a grant looks for them only
 * when it finds the row locked, and raises the register iff no sharer of
 * the row is left — else it waits, here until its `lock_timeout`.
 */
import { fc, test } from '@fast-check/vitest';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import type { LockIdentity } from '../../src/fencing/lock-identity.js';
import { registerTag } from '../../src/repo/register-key.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { uniqueNamespace } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { withholdingProxy } from '../support/withholding-proxy.js';
import { propertyParams, propertyRuns, propertyTimeout } from './support.js';

type Kind = 'redis' | 'postgres';
/** How a session waits when the raise comes. */
type Stall = 'idle' | 'busy' | 'copy' | 'answers withheld' | 'parse alone' | 'large result';
interface SessionSpec {
  /** Whose sharer it is: the raised lock, another name, or the raised name of the other kind. */
  readonly lock: 'L' | 'M' | 'L of the other kind';
  /** In another database of the same server (same tag, same lock identity). */
  readonly elsewhere: boolean;
  /** Its fence, relative to the register's R. */
  readonly fence: -1 | 0 | 1;
  /** It claimed too (the register row stays shared until its transaction ends), where there is a row at its fence. */
  readonly claims: boolean;
  readonly stall: Stall;
}
interface Case {
  readonly kind: Kind;
  /** The register's committed fence. */
  readonly r: bigint;
  readonly sessions: readonly SessionSpec[];
  /** `function`: end_stalled_sharers to R + delta; `claim`: the claim (Redis) or grant (Postgres) to R + delta. */
  readonly raise:
    | { readonly by: 'function'; readonly delta: -1 | 0 | 1 | 2 }
    | { readonly by: 'claim'; readonly delta: 1 | 2 };
  /** Another transaction raised the row to R + 1 and has not committed (only beside `function`). */
  readonly pending: boolean;
}

const IN_CLIENT: ReadonlySet<Stall> = new Set(['copy', 'answers withheld', 'parse alone', 'large result']);
// What pg_stat_activity shows for each stall: state, and the wait event (undefined: none asked).
const SHOWN: Record<Stall, readonly [string, string | undefined]> = {
  idle: ['idle in transaction', undefined],
  busy: ['active', 'PgSleep'],
  copy: ['active', 'ClientRead'],
  'answers withheld': ['active', 'ClientRead'],
  'parse alone': ['active', 'ClientRead'],
  'large result': ['active', 'ClientWrite'],
};

const sessionArb: fc.Arbitrary<SessionSpec> = fc.record({
  lock: fc.constantFrom<SessionSpec['lock']>('L', 'L', 'L', 'M', 'L of the other kind'),
  elsewhere: fc.constantFrom(false, false, false, true),
  fence: fc.constantFrom<SessionSpec['fence']>(0, 0, 0, -1, 1),
  claims: fc.boolean(),
  stall: fc.constantFrom<Stall>(
    'idle',
    'idle',
    'busy',
    'copy',
    'copy',
    'answers withheld',
    'answers withheld',
    'parse alone',
    'parse alone',
    'large result',
  ),
});
const caseArb: fc.Arbitrary<Case> = fc
  .record({
    kind: fc.constantFrom<Kind>('redis', 'postgres'),
    r: fc.oneof(fc.bigInt({ min: 2n, max: 1000n }), fc.bigInt({ min: 2n, max: 2n ** 63n - 3n })),
    sessions: fc.array(sessionArb, { minLength: 1, maxLength: 4 }),
    raise: fc.oneof(
      fc.record({ by: fc.constant('function' as const), delta: fc.constantFrom<-1 | 0 | 1 | 2>(1, 2, 0, -1) }),
      fc.record({ by: fc.constant('claim' as const), delta: fc.constantFrom<1 | 2>(1, 2) }),
    ),
    pending: fc.constantFrom(false, false, false, true),
  })
  .map((c) => ({ ...c, pending: c.pending && c.raise.by === 'function' }));

/** The model's answer for one case, per session: ended or not; and whether a claim is left waiting. */
function expected(c: Case): { ended: boolean[]; waits: boolean } {
  const holdsL = c.sessions.map((s) => sharesRow(c, s) && s.lock === 'L');
  const candidates = c.sessions.map((s) => !s.elsewhere && s.lock === 'L' && s.fence === 0 && IN_CLIENT.has(s.stall));
  if (c.raise.by === 'function') {
    const looks = !c.pending && c.raise.delta > 0;
    return { ended: candidates.map((x) => looks && x), waits: false };
  }
  const looks = holdsL.some(Boolean);
  const ended = candidates.map((x) => looks && x);
  return { ended, waits: holdsL.some((h, i) => h && !ended[i]) };
}

// Whether a session's claim shares a register row: the raised lock's and M's rows, in this database, at R.
// (A claim at another fence takes no lock; under an uncommitted raise a share of L's row would wait for it.)
const sharesRow = (c: Case, s: SessionSpec) =>
  s.claims && !s.elsewhere && s.fence === 0 && s.lock !== 'L of the other kind' && !(c.pending && s.lock === 'L');

describe.runIf(needs('DATABASE_URL'))(
  'a raise of a lock register ends exactly the stalled sharers of its fence',
  () => {
    let here: TestDatabase;
    let elsewhere: TestDatabase;
    let observer: postgres.Sql;
    let sourceId: string;
    beforeAll(async () => {
      [here, elsewhere] = await Promise.all([
        postgresDatabase({ migrated: true, max: 2 }),
        postgresDatabase({ migrated: true, max: 2 }),
      ]);
      observer = postgres(here.url as string, { max: 6, onnotice: () => {} });
      for (const url of [here.url, elsewhere.url]) {
        const sql = postgres(url as string, { max: 1, onnotice: () => {} });
        await sql`create table sink (v text)`;
        await sql.end();
      }
      sourceId = String((await observer`select palisade.fence_source_id() as id`)[0]?.id);
    });
    afterAll(async () => {
      await observer?.end({ timeout: 5 });
      await here?.close();
      await elsewhere?.close();
    });

    // The lock a session of case `c` shares, or the raised one.
    const identity = (c: Case, ns: string, which: SessionSpec['lock'] = 'L'): LockIdentity => {
      const kind = which === 'L of the other kind' ? (c.kind === 'redis' ? 'postgres' : 'redis') : c.kind;
      const source = c.kind === 'postgres' ? sourceId : 'redis-deployment';
      return Object.freeze({ kind, source, namespace: ns, name: which === 'M' ? 'M' : 'L' });
    };

    interface Opened {
      readonly pid: number;
      end(): Promise<void>;
    }

    // Opens a session as `spec` says, through a proxy, and leaves it waiting as `spec.stall` says.
    async function open(c: Case, ns: string, spec: SessionSpec): Promise<Opened> {
      const url = (spec.elsewhere ? elsewhere.url : here.url) as string;
      const lock = identity(c, ns, spec.lock);
      const fence = c.r + BigInt(spec.fence);
      const [tag1, tag2] = registerTag(lock, fence);
      const claim = sharesRow(c, spec);
      const proxy = withholdingProxy(url);
      const proxied = await proxy.url();
      // The tag and the claim as palisade sends them (lock-scope.ts).
      const tagText = 'select pg_try_advisory_xact_lock_shared($1::int4, $2::int4) as tagged';
      const claimText =
        'select palisade.claim_lock($1::text, $2::text, $3::text, $4::text, $5::int8)::text as registered';
      const claimArgs = [lock.kind, lock.source, lock.namespace, lock.name, fence.toString()];

      if (spec.stall === 'parse alone') {
        const client = new pg.Client({ connectionString: proxied });
        client.on('error', () => {});
        await client.connect();
        await client.query('begin');
        const pid = Number((await client.query('select pg_backend_pid() as pid')).rows[0]?.pid);
        await client.query(tagText, [tag1, tag2]);
        if (claim) expect((await client.query(claimText, claimArgs)).rows[0]?.registered).toBe(String(fence));
        proxy.state.splitAfterParse = true;
        const stalled = client.query('select $1::int as palisade_stalled_marker', [1]).catch(() => {});
        await shows(pid, spec.stall);
        return {
          pid,
          async end() {
            await observer`select pg_terminate_backend(${pid})`;
            proxy.close();
            await stalled;
            await client.end().catch(() => {});
          },
        };
      }

      const client = postgres(proxied, { max: 1, onnotice: () => {} });
      // Reserved rather than `begin`: begin's own rollback after the server ends the session would be written
      // to a socket postgres.js has let go of.
      const conn = await client.reserve();
      await conn`begin`;
      const pid = Number((await conn`select pg_backend_pid() as pid`)[0]?.pid);
      await conn.unsafe(tagText, [tag1, tag2]);
      if (claim) expect((await conn.unsafe(claimText, claimArgs))[0]?.registered).toBe(String(fence));
      let stalled: Promise<unknown> = Promise.resolve();
      if (spec.stall === 'busy') stalled = conn`select pg_sleep(600)`.catch(() => {});
      else if (spec.stall === 'copy') {
        // The COPY is a query too: it rejects when the session is ended, and its stream errs.
        const copy = conn`copy sink from stdin`;
        const stream = await copy.writable();
        stream.on('error', () => {});
        stalled = copy.catch(() => {});
      } else if (spec.stall === 'answers withheld') {
        proxy.state.withhold = true;
        stalled = conn`select ${1}::int as palisade_stalled_marker`.catch(() => {});
      } else if (spec.stall === 'large result') {
        proxy.state.stopReading = true;
        stalled = conn`select repeat('x', 1048576) from generate_series(1, 64)`.catch(() => {});
      }
      await shows(pid, spec.stall);
      return {
        pid,
        async end() {
          await observer`select pg_terminate_backend(${pid})`;
          proxy.close();
          await stalled;
          conn.release();
          await client.end({ timeout: 0 });
        },
      };
    }

    // Waits (bounded: 400 looks, 25 ms apart) until the session `pid` shows as `stall` does.
    async function shows(pid: number, stall: Stall): Promise<void> {
      const [state, event] = SHOWN[stall];
      for (let i = 0; i < 400; i++) {
        const [row] = await observer`select state, wait_event from pg_stat_activity where pid = ${pid}`;
        if (row?.state === state && (event === undefined || row.wait_event === event)) return;
        await new Promise((resolve) => setTimeout(resolve, 25));
      }
      throw new Error(`session ${pid} never showed as ${stall}`);
    }

    const alive = async (pid: number) =>
      (await observer`select 1 from pg_stat_activity where pid = ${pid}`).length === 1;

    // The raise the case asks for; what it returned (end_stalled_sharers: how many it ended; a claim or a
    // grant: the register's fence), or 'waited' when it ran into its lock_timeout.
    async function raise(c: Case, ns: string, waits: boolean): Promise<bigint | 'waited'> {
      const lock = identity(c, ns);
      const to = (c.r + BigInt(c.raise.delta)).toString();
      const conn = await observer.reserve();
      try {
        await conn`begin`;
        // A claim the model expects to wait is given 300 ms; one it expects through, 10 s (a bound, not a timing).
        await conn`select set_config('lock_timeout', ${waits ? '300' : '10000'}, true)`;
        const [row] =
          c.raise.by === 'function'
            ? await conn`select palisade.end_stalled_sharers(${lock.kind}, ${lock.source}, ${ns}, 'L', ${to}::int8)::text as v`
            : c.kind === 'redis'
              ? await conn`select palisade.claim_lock(${lock.kind}, ${lock.source}, ${ns}, 'L', ${to}::int8)::text as v`
              : await conn`select palisade.register_grant(${lock.kind}, ${ns}, 'L', ${to}::int8)::text as v`;
        await conn`commit`;
        return BigInt(String(row?.v));
      } catch (err) {
        await conn`rollback`.catch(() => {});
        if ((err as { code?: string }).code === '55P03') return 'waited';
        throw err;
      } finally {
        conn.release();
      }
    }

    test.prop([caseArb], propertyParams({ numRuns: propertyRuns(160) }))(
      'ends the sharers the model ends, and only those',
      async (c) => {
        const ns = uniqueNamespace('ss');
        const { ended, waits } = expected(c);
        await observer`insert into palisade.lock_registers (kind, source, namespace, name, fence) values
        (${identity(c, ns).kind}, ${identity(c, ns).source}, ${ns}, 'L', ${c.r.toString()}::int8),
        (${identity(c, ns).kind}, ${identity(c, ns).source}, ${ns}, 'M', ${c.r.toString()}::int8)`;
        const pending = c.pending ? await observer.reserve() : undefined;
        const sessions: Opened[] = [];
        try {
          if (pending) {
            await pending`begin`;
            await pending`update palisade.lock_registers set fence = fence + 1 where namespace = ${ns} and name = 'L'`;
          }
          const opening = await Promise.allSettled(c.sessions.map((s) => open(c, ns, s)));
          for (const o of opening) if (o.status === 'fulfilled') sessions.push(o.value);
          for (const o of opening) if (o.status === 'rejected') throw o.reason;

          const result = await raise(c, ns, waits);
          if (c.raise.by === 'function') expect(result).toBe(BigInt(ended.filter(Boolean).length));
          else expect(result).toBe(waits ? 'waited' : c.r + BigInt(c.raise.delta));

          // The ended ones go (bounded: 400 looks, 25 ms apart); then every other one is still there.
          for (const [i, s] of sessions.entries()) {
            if (!ended[i]) continue;
            for (let n = 0; n < 400 && (await alive(s.pid)); n++)
              await new Promise((resolve) => setTimeout(resolve, 25));
            expect(await alive(s.pid), `session ${i} (${c.sessions[i]?.stall}) was to be ended`).toBe(false);
          }
          for (const [i, s] of sessions.entries()) {
            if (!ended[i]) expect(await alive(s.pid), `session ${i} (${c.sessions[i]?.stall}) was to stay`).toBe(true);
          }
        } finally {
          await Promise.all(sessions.map((s) => s.end()));
          if (pending) {
            await pending`rollback`.catch(() => {});
            pending.release();
          }
        }
      },
      propertyTimeout(600_000),
    );
  },
);
