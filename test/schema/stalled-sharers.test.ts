/**
 * Which sessions a raise of a lock register ends (migration 0009,
 * `palisade.end_stalled_sharers`): only those that palisade tagged as the
 * register row's sharers (a shared advisory lock named by
 * `palisade.register_tag`, taken with every claim kept past its statement) while they are stalled in the middle of a statement. A postgres.js client behind a
 * proxy that stops passing the server's answers is such a session: it sent a
 * new statement to be described (Parse, Describe, Flush) and never binds it.
 * The processes that are stopped for real, and the grants and raises that end
 * them, are in test/repo/lock-scope.test.ts.
 */
import { randomBytes } from 'node:crypto';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { TestDatabase } from '../support/databases.js';
import { scenarioDatabase } from '../support/scenario.js';
import { needs } from '../support/services.js';
import { withholdingProxy } from '../support/withholding-proxy.js';

describe.runIf(needs('DATABASE_URL'))('a raise of a lock register ends only stalled sharers (real Postgres)', () => {
  let scenario: TestDatabase;
  let observer: postgres.Sql;
  beforeAll(async () => {
    scenario = await scenarioDatabase();
    observer = postgres(scenario.url as string, { max: 2, onnotice: () => {} });
    await observer`insert into palisade.lock_registers (kind, source, namespace, name, fence)
      values ('redis', 'src', 'ns', 'L', 5), ('redis', 'src', 'ns', 'M', 5)`;
  });
  afterAll(async () => {
    await observer?.end({ timeout: 5 });
    await scenario?.close();
  });

  // Opens a transaction through a proxy, runs `inside` in it, then (if `stall`) sends a statement new on
  // the connection with the server's answers held back: the session waits for its client mid-statement
  // (ClientRead). `'large result'`: the proxy stops reading, and the server waits to send a result that
  // fills the socket buffers (ClientWrite).
  async function session(inside: (tx: postgres.ReservedSql) => Promise<unknown>, stall: boolean | 'large result') {
    const proxy = withholdingProxy(scenario.url as string);
    const client = postgres(await proxy.url(), { max: 1, onnotice: () => {} });
    // A reserved connection rather than `begin`: begin's own rollback after the connection closes would
    // be written to a socket postgres.js has let go of, which throws where nothing can catch it.
    const conn = await client.reserve();
    await conn`begin`;
    await inside(conn);
    let stalled: Promise<unknown> = Promise.resolve();
    if (stall === 'large result') {
      proxy.state.stopReading = true;
      stalled = conn`select repeat('x', 1048576) from generate_series(1, 64)`.catch(() => {});
    } else if (stall) {
      proxy.state.withhold = true;
      stalled = conn`select ${1}::int as palisade_stalled_marker`.catch(() => {});
    }
    const pid =
      stall === 'large result'
        ? await waitFor('active', 'ClientWrite')
        : await waitFor(stall ? 'active' : 'idle in transaction');
    return {
      pid,
      async alive() {
        return (await observer`select 1 from pg_stat_activity where pid = ${pid}`).length === 1;
      },
      async end() {
        await observer`select pg_terminate_backend(${pid})`;
        proxy.close();
        await stalled;
        conn.release();
        await client.end({ timeout: 1 });
      },
    };
  }

  // The one session not seen before in `state` (waiting on `event`, if given) (bounded: 400 looks, 25 ms apart).
  const seen: number[] = [];
  async function waitFor(state: string, event?: string): Promise<number> {
    for (let i = 0; i < 400; i++) {
      const rows = await observer<{ pid: number }[]>`select pid from pg_stat_activity
        where state = ${state} and pid <> pg_backend_pid() and datname = current_database()
          and backend_xid is not null and pid <> all(${seen}::int[])
          and (${event ?? null}::text is null or wait_event = ${event ?? null})`;
      if (rows.length === 1 && rows[0]) {
        seen.push(rows[0].pid);
        return rows[0].pid;
      }
      await new Promise((resolve) => setTimeout(resolve, 25));
    }
    throw new Error(`no session ${state} ${event ?? ''}`);
  }

  // What a raise of `name` to `fence` ends (the registers are at 5).
  const endStalled = async (name: string, fence = 7) =>
    Number((await observer`select palisade.end_stalled_sharers('redis', 'src', 'ns', ${name}, ${fence}) as n`)[0]?.n);
  // The tag that names a session as a sharer of `name`'s register at `fence`, as palisade takes it.
  const tag = (tx: postgres.ReservedSql, name: string, fence: number) =>
    tx`select pg_try_advisory_xact_lock_shared(t.k1, t.k2)
      from palisade.register_tag(palisade.lock_key('redis', 'src', 'ns', ${name}), ${fence}) t`;
  // A claim as palisade keeps one past its statement: the claim, and the tag.
  const claim = (tx: postgres.ReservedSql, name: string, fence: number) =>
    tx`select palisade.claim_lock('redis', 'src', 'ns', ${name}, ${fence}),
      (select pg_try_advisory_xact_lock_shared(t.k1, t.k2) from palisade.register_tag(palisade.lock_key('redis', 'src', 'ns', ${name}), ${fence}) t)`;
  const shareL = (tx: postgres.ReservedSql) => claim(tx, 'L', 5);

  it('ends a session that shares the register and waits for its client mid-statement', async () => {
    const s = await session(shareL, true);
    try {
      expect(await endStalled('L')).toBe(1);
      for (let i = 0; i < 200 && (await s.alive()); i++) await new Promise((resolve) => setTimeout(resolve, 25));
      expect(await s.alive()).toBe(false);
    } finally {
      await s.end();
    }
  });

  // A lock-scoped write in a transaction tags it (the statement that bounds its idle time) before its claim
  // raises the register: the newest holder's session, tagged and stalled on its way (postgres.js describes
  // a new statement before it binds it), while another call of its lease raises past a stale sharer. An
  // attack saw 0009's raise end it in 13 of 150 trials.
  it('ends only the sharers tagged at the register’s fence: a session tagged at the raising fence is the newest holder’s', async () => {
    const stale = await session(shareL, true);
    // Tagged, its transaction begun (an xid, as its bound's set_config would not give it).
    const newest = await session(async (tx) => {
      await tx`select txid_current()`;
      await tag(tx, 'L', 7);
    }, true);
    try {
      expect(await endStalled('L', 7)).toBe(1);
      for (let i = 0; i < 200 && (await stale.alive()); i++) await new Promise((resolve) => setTimeout(resolve, 25));
      expect(await stale.alive()).toBe(false);
      expect(await newest.alive()).toBe(true);
    } finally {
      await stale.end();
      await newest.end();
    }
  });

  it('ends a sharer stopped while the server sends it a large result (waiting on ClientWrite)', async () => {
    const s = await session(shareL, 'large result');
    try {
      expect(await endStalled('L')).toBe(1);
    } finally {
      await s.end();
    }
  });

  // Postgres keeps one snapshot of pg_stat_activity per transaction: a raise in a transaction that had read
  // it (a fenced transaction's claim of two locks, waiting on the first) saw a sharer that stalled later as
  // it was then. An attack saw such a transaction wait for as long as the sharer was stopped.
  it('sees the sessions as they are now, in a transaction that read pg_stat_activity before', async () => {
    const reader = await observer.reserve();
    try {
      await reader`begin`;
      await reader`select count(*) from pg_stat_activity`;
      const s = await session(shareL, true);
      try {
        const [row] = await reader`select palisade.end_stalled_sharers('redis', 'src', 'ns', 'L', 7) as n`;
        expect(Number(row?.n)).toBe(1);
      } finally {
        await s.end();
      }
    } finally {
      await reader`rollback`;
      reader.release();
    }
  });

  // A claim in a savepoint locks the row with the savepoint's id, which Postgres stops tying to the
  // session once the savepoint is released; the tag moves to the transaction with the savepoint's locks.
  it('ends such a sharer whose claim ran in a savepoint, released or not', async () => {
    for (const release of [false, true]) {
      const s = await session(async (tx) => {
        await tx`savepoint claim`;
        await shareL(tx);
        if (release) await tx`release savepoint claim`;
      }, true);
      try {
        expect(await endStalled('L')).toBe(1);
      } finally {
        await s.end();
      }
    }
  });

  // A stale claim reads the register, then a newer holder raises it and shares it at its own fence:
  // the stale claim's raise must not end that holder. The function reads the fence again, locked.
  it('ends nobody for a raise to a fence at or below the register’s (the sharers are the newest holder’s)', async () => {
    const s = await session(shareL, true);
    try {
      expect(await endStalled('L', 5)).toBe(0);
      expect(await endStalled('L', 4)).toBe(0);
      expect(await s.alive()).toBe(true);
    } finally {
      await s.end();
    }
  });

  // The race itself: a stale claim (fence 5) reads the register at 4; a newer holder raises it to 6,
  // commits, and shares it (tagged) in its next transaction while a statement of it waits for its
  // description. The stale claim's raise then finds the row locked. A queued ACCESS EXCLUSIVE lock on
  // palisade.fence_sources (which that claim reads in between, for a lock of another source) holds
  // it there, as a descheduled backend would be held.
  it('a stale claim that read the register before a newer holder raised it does not end that holder', async () => {
    await observer`insert into palisade.lock_registers (kind, source, namespace, name, fence) values ('postgres', 'other', 'ns', 'W', 4)`;
    const proxy = withholdingProxy(scenario.url as string);
    const newer = postgres(await proxy.url(), { max: 1, onnotice: () => {} });
    const stale = postgres(scenario.url as string, { max: 1, onnotice: () => {} });
    const harness = postgres(scenario.url as string, { max: 1, onnotice: () => {} });
    const b = await newer.reserve();
    const h = await harness.reserve();
    try {
      const stalePid = Number((await stale`select pg_backend_pid() as pid`)[0]?.pid);
      const harnessPid = Number((await h`select pg_backend_pid() as pid`)[0]?.pid);
      const waiting = async (pid: number, event: string) => {
        for (let i = 0; i < 200; i++) {
          const [row] = await observer`select wait_event from pg_stat_activity where pid = ${pid}`;
          if (row?.wait_event === event) return;
          await new Promise((resolve) => setTimeout(resolve, 25));
        }
        throw new Error(`session ${pid} never waited on ${event}`);
      };
      const claimW = (tx: postgres.ReservedSql | postgres.Sql, fence: number) =>
        tx`select palisade.claim_lock('postgres', 'other', 'ns', 'W', ${fence})::text as registered,
          (select pg_try_advisory_xact_lock_shared(t.k1, t.k2) from palisade.register_tag(palisade.lock_key('postgres', 'other', 'ns', 'W'), ${fence}) t)`;
      await b`begin`;
      await claimW(b, 6); // the newer holder's raise, not committed yet
      await h`begin`;
      const locked = h`lock table palisade.fence_sources in access exclusive mode`.execute();
      // Queued behind the newer holder's read before the stale claim reads the table: sent at once, the claim
      // could pass it first and wait on the register row instead (CI once, on a loaded machine).
      await waiting(harnessPid, 'relation');
      const staleClaim = claimW(stale, 5).execute();
      await waiting(stalePid, 'relation');
      await b`commit`;
      await locked;
      await b`begin`;
      await claimW(b, 6); // shares at its own fence, tagged
      const newerPid = Number((await b`select pg_backend_pid() as pid`)[0]?.pid);
      proxy.state.withhold = true;
      const next = b`select ${42}::int as palisade_stalled_marker`.execute();
      await waiting(newerPid, 'ClientRead');
      await h`commit`;
      expect((await staleClaim)[0]?.registered).toBe('6');
      proxy.state.withhold = false;
      proxy.release();
      expect((await next)[0]?.palisade_stalled_marker).toBe(42);
      await b`commit`;
    } finally {
      h.release();
      b.release();
      await Promise.all([newer.end({ timeout: 1 }), stale.end({ timeout: 1 }), harness.end({ timeout: 1 })]);
      proxy.close();
    }
  });

  it('leaves a sharer idle in its transaction (its idle timeout ends it), and a stalled sharer of another lock', async () => {
    const idle = await session(shareL, false);
    try {
      expect(await endStalled('L')).toBe(0);
      expect(await idle.alive()).toBe(true);
    } finally {
      await idle.end();
    }
    const other = await session((tx) => claim(tx, 'M', 5), true);
    try {
      expect(await endStalled('L')).toBe(0);
      expect(await other.alive()).toBe(true);
    } finally {
      await other.end();
    }
  });

  it('ends a stalled sharer that raised another lock’s register in its transaction', async () => {
    await observer`insert into palisade.lock_registers (kind, source, namespace, name, fence) values ('redis', 'src', 'ns', 'R', 1)`;
    const s = await session(async (tx) => {
      await claim(tx, 'R', 2);
      await shareL(tx);
    }, true);
    try {
      expect(await endStalled('L')).toBe(1);
    } finally {
      await s.end();
    }
  });

  it('leaves a stalled sharer without the tag (a claim palisade did not send)', async () => {
    const s = await session((tx) => tx`select palisade.claim_lock('redis', 'src', 'ns', 'L', 5)`, true);
    try {
      expect(await endStalled('L')).toBe(0);
      expect(await s.alive()).toBe(true);
    } finally {
      await s.end();
    }
  });

  // README: a session of a role the raising one may not signal is left alone, and the raise waits as before.
  it('leaves a stalled sharer of a role the raising session may not signal, without an error', async () => {
    const role = `palisade_t_role_${randomBytes(6).toString('hex')}`;
    await observer.unsafe(`create role ${role} login`);
    const url = new URL(scenario.url as string);
    url.username = role;
    const other = postgres(url.toString(), { max: 1, onnotice: () => {} });
    const s = await session(shareL, true);
    try {
      // It sees the stalled session (pg_read_all_stats) but may not signal it: pg_terminate_backend refuses.
      await observer.unsafe(`grant pg_read_all_stats to ${role}`);
      await observer.unsafe(`grant usage on schema palisade to ${role}`);
      await observer.unsafe(`grant select, update on palisade.lock_registers to ${role}`);
      const [row] = await other`select palisade.end_stalled_sharers('redis', 'src', 'ns', 'L', 7) as n`;
      expect(Number(row?.n)).toBe(0);
      expect(await s.alive()).toBe(true);
    } finally {
      await s.end();
      await other.end({ timeout: 1 });
      await observer.unsafe(`drop owned by ${role}`);
      await observer.unsafe(`drop role ${role}`);
    }
  });

  it('ends nobody while a raise not yet committed holds the register: it may be the newest holder’s', async () => {
    const raiser = await session((tx) => claim(tx, 'L', 6), true);
    try {
      expect(await endStalled('L')).toBe(0);
      expect(await raiser.alive()).toBe(true);
    } finally {
      await raiser.end();
    }
    // Rolled back with its session: the register is where it was.
    const [row] = await observer`select fence::text from palisade.lock_registers where name = 'L'`;
    expect(row?.fence).toBe('5');
  });
});
