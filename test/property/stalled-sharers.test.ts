/**
 * Which sessions a raise of a lock register ends (migrations 0009 and 0010;
 * README, "Known limits"), searched on a REAL Postgres. Each case opens a
 * session and a few near-misses of it, each differing from it in one thing:
 * whose sharer it is (the raised lock, another name, the same name of the
 * other kind), its fence (the register's R, or next to it), whether it shares
 * the register row, whether palisade's tag marks it (the client's
 * `registerTag`), its database, and how it waits — idle in its transaction,
 * busy in a statement, or stalled mid-statement the ways a paused holder or
 * a link stalls one: a COPY waiting for its data, a statement whose answers
 * a proxy withholds (postgres.js), a Parse whose Bind a proxy holds back
 * (node-postgres), a large result the proxy stops reading. Then one raise,
 * by `end_stalled_sharers` itself, by a claim (`claim_lock`, a Redis lock)
 * or by a grant (`register_grant`, a Postgres lease), maybe in a transaction
 * that read `pg_stat_activity` before the sessions began, maybe while
 * another transaction holds an uncommitted raise of the register.
 *
 * The model: a raise above the register's committed fence R ends exactly
 * the sessions of this database tagged as sharers of that lock at R that
 * wait for their client mid-statement (ClientRead, ClientWrite); nobody when
 * it is not above R, nor while another transaction holds the row (that
 * raise may be the newest holder's). A claim or a grant looks for them only
 * when it finds the row locked, and raises the register iff no sharer of
 * the row is left and no raise holds it — else it waits, here until its
 * `lock_timeout`. Every session the model keeps must then answer: its stall
 * is undone, its statement completes, and it runs one more.
 */
import { fc, test } from '@fast-check/vitest';
import pg from 'pg';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect } from 'vitest';
import type { LockIdentity } from '../../src/fencing/lock-identity.js';
import { registerTag } from '../../src/repo/register-key.js';
import { postgresDatabase, type TestDatabase } from '../support/databases.js';
import { eventually } from '../support/lock-workers.js';
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
  /** It claimed too: where the register has a row at its fence, that row stays shared until its transaction ends. */
  readonly claims: boolean;
  /** palisade's tag marks it as the register's sharer at its fence (a single statement outside a transaction has none). */
  readonly tagged: boolean;
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
  /** Another transaction raised the row to R + 1 and has not committed. */
  readonly pending: boolean;
  /** The raise's transaction read pg_stat_activity before the sessions began (Postgres keeps that snapshot). */
  readonly lookedFirst: boolean;
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
  tagged: fc.constantFrom(true, true, true, false),
  // A large result is the costliest to set up and to answer (64 MB through the proxy): half the weight.
  stall: fc.constantFrom<Stall>(
    'idle',
    'idle',
    'busy',
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
// The session a raise is about: a tagged sharer of the raised lock at R, stalled mid-statement.
const candidateArb: fc.Arbitrary<SessionSpec> = fc.record({
  lock: fc.constant('L' as const),
  elsewhere: fc.constant(false),
  fence: fc.constant(0 as const),
  claims: fc.constant(true),
  tagged: fc.constant(true),
  stall: fc.constantFrom<Stall>('copy', 'answers withheld', 'parse alone', 'large result'),
});
// A near-miss of a session: the same but for one thing, taken from another random session.
const ATTRIBUTES = ['lock', 'elsewhere', 'fence', 'claims', 'tagged', 'stall'] as const;
const twinArb = fc.tuple(fc.constantFrom(...ATTRIBUTES), sessionArb);
const caseArb: fc.Arbitrary<Case> = fc
  .record({
    kind: fc.constantFrom<Kind>('redis', 'postgres'),
    r: fc.oneof(fc.bigInt({ min: 2n, max: 1000n }), fc.bigInt({ min: 2n, max: 2n ** 63n - 3n })),
    // Half the cases are about a candidate and its near-misses.
    base: fc.oneof(candidateArb, sessionArb),
    twins: fc.array(twinArb, { minLength: 0, maxLength: 3 }),
    raise: fc.oneof(
      fc.record({ by: fc.constant('function' as const), delta: fc.constantFrom<-1 | 0 | 1 | 2>(1, 2, 0, -1) }),
      fc.record({ by: fc.constant('claim' as const), delta: fc.constantFrom<1 | 2>(1, 2) }),
    ),
    pending: fc.constantFrom(false, false, false, true),
    lookedFirst: fc.constantFrom(false, false, true),
  })
  .map(({ base, twins, ...c }) => ({
    ...c,
    sessions: [base, ...twins.map(([attribute, other]) => ({ ...base, [attribute]: other[attribute] }))],
  }));

// Whether a session's claim shares a register row: the raised lock's and M's rows, in this database, at R.
// (A claim at another fence takes no lock; under an uncommitted raise a share of L's row would wait for it.)
const sharesRow = (c: Case, s: SessionSpec) =>
  s.claims && !s.elsewhere && s.fence === 0 && s.lock !== 'L of the other kind' && !(c.pending && s.lock === 'L');

/** The model's answer for one case, per session: ended or not; and whether a claim or grant is left waiting. */
function expected(c: Case): { ended: boolean[]; waits: boolean } {
  const holdsL = c.sessions.map((s) => sharesRow(c, s) && s.lock === 'L');
  const candidates = c.sessions.map(
    (s) => s.tagged && !s.elsewhere && s.lock === 'L' && s.fence === 0 && IN_CLIENT.has(s.stall),
  );
  // The raise reads the row FOR SHARE SKIP LOCKED: under an uncommitted raise it finds nothing, ends nobody.
  if (c.raise.by === 'function') {
    const looks = !c.pending && c.raise.delta > 0;
    return { ended: candidates.map((x) => looks && x), waits: false };
  }
  const looks = holdsL.some(Boolean) && !c.pending;
  const ended = candidates.map((x) => looks && x);
  return { ended, waits: c.pending || holdsL.some((h, i) => h && !ended[i]) };
}

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

    /** A session as the server knows it: its pid and start (a pid alone may be reused). */
    interface Backend {
      readonly pid: number;
      readonly started: string;
    }
    interface Opened extends Backend {
      /** Undoes the stall and has the session finish its statement and run one more: throws if it was ended. */
      answer(): Promise<void>;
      /** Ends the session (whatever became of it) and lets go of its client and proxy. */
      end(): Promise<void>;
    }

    const backendOf = async (pid: number): Promise<Backend> => {
      const [row] = await observer`select backend_start::text as started from pg_stat_activity where pid = ${pid}`;
      return { pid, started: String(row?.started) };
    };
    const alive = async ({ pid, started }: Backend) =>
      (await observer`select 1 from pg_stat_activity where pid = ${pid} and backend_start::text = ${started}`)
        .length === 1;

    // Opens a session as `spec` says, through a proxy, and leaves it waiting as `spec.stall` says. On any
    // failure on the way, what it opened is ended before the error goes on.
    async function open(c: Case, ns: string, spec: SessionSpec): Promise<Opened> {
      const url = (spec.elsewhere ? elsewhere.url : here.url) as string;
      const lock = identity(c, ns, spec.lock);
      const fence = c.r + BigInt(spec.fence);
      const [tag1, tag2] = registerTag(lock, fence);
      const claim = sharesRow(c, spec);
      // The tag and the claim as palisade sends them (register-claim.ts).
      const tagText = 'select pg_try_advisory_xact_lock_shared($1::int4, $2::int4) as tagged';
      const claimText =
        'select palisade.claim_lock($1::text, $2::text, $3::text, $4::text, $5::int8)::text as registered';
      const claimArgs = [lock.kind, lock.source, lock.namespace, lock.name, fence.toString()];
      const proxy = withholdingProxy(url);
      const proxied = await proxy.url();
      let pid: number | undefined;
      const closers: (() => Promise<unknown>)[] = [];
      const end = async () => {
        if (pid !== undefined) await observer`select pg_terminate_backend(${pid})`;
        proxy.close();
        for (const close of closers) await close().catch(() => {});
      };
      try {
        if (spec.stall === 'parse alone') {
          const client = new pg.Client({ connectionString: proxied });
          client.on('error', () => {});
          closers.push(() => client.end());
          await client.connect();
          await client.query('begin');
          pid = Number((await client.query('select pg_backend_pid() as pid')).rows[0]?.pid);
          if (spec.tagged) expect((await client.query(tagText, [tag1, tag2])).rows[0]?.tagged).toBe(true);
          if (claim) expect((await client.query(claimText, claimArgs)).rows[0]?.registered).toBe(String(fence));
          proxy.state.splitAfterParse = true;
          const stalled = client.query('select $1::int as palisade_stalled_marker', [1]);
          stalled.catch(() => {});
          closers.unshift(() => stalled);
          await shows(pid, spec.stall);
          const backend = await backendOf(pid);
          return {
            ...backend,
            async answer() {
              proxy.release();
              expect((await stalled).rows[0]?.palisade_stalled_marker).toBe(1);
              expect(Number((await client.query('select pg_backend_pid() as pid')).rows[0]?.pid)).toBe(backend.pid);
            },
            end,
          };
        }

        const client = postgres(proxied, { max: 1, onnotice: () => {} });
        closers.push(() => client.end({ timeout: 0 }));
        // Reserved rather than `begin`: begin's own rollback after the server ends the session would be
        // written to a socket postgres.js has let go of.
        const conn = await client.reserve();
        closers.unshift(async () => conn.release());
        await conn`begin`;
        pid = Number((await conn`select pg_backend_pid() as pid`)[0]?.pid);
        if (spec.tagged) expect((await conn.unsafe(tagText, [tag1, tag2]))[0]?.tagged).toBe(true);
        if (claim) expect((await conn.unsafe(claimText, claimArgs))[0]?.registered).toBe(String(fence));
        // The statement the session is stalled in (none when idle), and how to see it finish.
        let finish: () => Promise<unknown> = async () => {};
        if (spec.stall === 'busy') {
          const sleep = conn`select pg_sleep(600)`;
          sleep.catch(() => {});
          closers.unshift(() => sleep);
          // Cancelled, the statement fails (57014) and the session lives on, its transaction aborted.
          finish = async () => {
            await observer`select pg_cancel_backend(${pid as number})`;
            await expect(sleep).rejects.toMatchObject({ code: '57014' });
          };
        } else if (spec.stall === 'copy') {
          // The COPY resolves as soon as the server waits for its data (with the stream to send them on).
          const stream = await conn`copy sink from stdin`.writable();
          stream.on('error', () => {});
          finish = () =>
            new Promise<void>((resolve, reject) => stream.end('answered\n', () => resolve()).on('error', reject));
        } else if (spec.stall === 'answers withheld' || spec.stall === 'large result') {
          if (spec.stall === 'answers withheld') proxy.state.withhold = true;
          else proxy.state.stopReading = true;
          const stalled =
            spec.stall === 'answers withheld'
              ? conn`select ${1}::int as palisade_stalled_marker`
              : conn`select repeat('x', 1048576) as x from generate_series(1, 64)`;
          stalled.catch(() => {});
          closers.unshift(() => stalled);
          finish = async () => {
            proxy.release();
            expect((await stalled).length).toBe(spec.stall === 'answers withheld' ? 1 : 64);
          };
        }
        await shows(pid, spec.stall);
        const backend = await backendOf(pid);
        return {
          ...backend,
          async answer() {
            await finish();
            // In order behind what it stalled in; a transaction a cancel aborted still takes a rollback.
            await conn`rollback`;
            expect(Number((await conn`select pg_backend_pid() as pid`)[0]?.pid)).toBe(backend.pid);
          },
          end,
        };
      } catch (err) {
        await end();
        throw err;
      }
    }

    // `promise`, or a rejection naming `what` after 10 s: a session that does not answer fails the case
    // rather than hanging it.
    const within = <T>(promise: Promise<T>, what: string): Promise<T> => {
      let timer: NodeJS.Timeout | undefined;
      const late = new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(new Error(`${what}: no answer within 10 s`)), 10_000);
      });
      return Promise.race([promise, late]).finally(() => clearTimeout(timer));
    };

    // Waits (bounded: 400 looks, 25 ms apart) until the session `pid` shows as `stall` does.
    async function shows(pid: number, stall: Stall): Promise<void> {
      const [state, event] = SHOWN[stall];
      const seen = await eventually(
        async () => {
          const [row] = await observer`select state, wait_event from pg_stat_activity where pid = ${pid}`;
          return row?.state === state && (event === undefined || row.wait_event === event);
        },
        400,
        25,
      );
      if (!seen) throw new Error(`session ${pid} never showed as ${stall}`);
    }

    // The raise the case asks for, on `conn` in its open transaction; what it returned (end_stalled_sharers:
    // how many it ended; a claim or a grant: the register's fence), or 'waited' when it ran into its lock_timeout.
    async function raise(conn: postgres.ReservedSql, c: Case, ns: string, waits: boolean): Promise<bigint | 'waited'> {
      const lock = identity(c, ns);
      const to = (c.r + BigInt(c.raise.delta)).toString();
      try {
        // A claim the model expects to wait is given 200 ms; one it expects through, 10 s (a bound, not a timing).
        await conn`select set_config('lock_timeout', ${waits ? '200' : '10000'}, true)`;
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
      }
    }

    test.prop([caseArb], propertyParams({ numRuns: propertyRuns(120) }))(
      'ends the sharers the model ends, and only those',
      async (c) => {
        const ns = uniqueNamespace('ss');
        const { ended, waits } = expected(c);
        const { kind, source } = identity(c, ns);
        await observer`insert into palisade.lock_registers (kind, source, namespace, name, fence) values
        (${kind}, ${source}, ${ns}, 'L', ${c.r.toString()}::int8), (${kind}, ${source}, ${ns}, 'M', ${c.r.toString()}::int8)`;
        const raiser = await observer.reserve();
        const pending = c.pending ? await observer.reserve() : undefined;
        const sessions: Opened[] = [];
        try {
          await raiser`begin`;
          if (c.lookedFirst) await raiser`select count(*) from pg_stat_activity`;
          if (pending) {
            await pending`begin`;
            await pending`update palisade.lock_registers set fence = fence + 1 where namespace = ${ns} and name = 'L'`;
          }
          const opening = await Promise.allSettled(c.sessions.map((s) => open(c, ns, s)));
          for (const o of opening) if (o.status === 'fulfilled') sessions.push(o.value);
          for (const o of opening) if (o.status === 'rejected') throw o.reason;

          const result = await raise(raiser, c, ns, waits);
          if (c.raise.by === 'function') expect(result).toBe(BigInt(ended.filter(Boolean).length));
          else expect(result).toBe(waits ? 'waited' : c.r + BigInt(c.raise.delta));

          // The ended ones go (bounded: 200 looks, 25 ms apart); every other one answers.
          for (const [i, s] of sessions.entries()) {
            if (!ended[i]) continue;
            const gone = await eventually(async () => !(await alive(s)), 200, 25);
            expect(gone, `session ${i} (${c.sessions[i]?.stall}) was to be ended`).toBe(true);
          }
          for (const [i, s] of sessions.entries()) {
            if (ended[i]) continue;
            const what = `session ${i} (${c.sessions[i]?.stall}) was to stay`;
            await expect(within(s.answer(), what), what).resolves.toBeUndefined();
          }
        } finally {
          await Promise.allSettled(sessions.map((s) => within(s.end(), 'ending a session')));
          await raiser`rollback`.catch(() => {});
          raiser.release();
          if (pending) {
            await pending`rollback`.catch(() => {});
            pending.release();
          }
        }
      },
      // A failing case costs up to ~10 s (the bounded waits): room for shrinking it.
      Math.max(propertyTimeout(600_000), 600_000),
    );
  },
);
