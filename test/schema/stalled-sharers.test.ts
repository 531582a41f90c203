/**
 * Which sessions a raise of a lock register ends (migration 0009,
 * `palisade.end_stalled_sharers`): only those that palisade tagged as the
 * register row's sharers (`palisade.tag_claims`, sent with every claim kept
 * past its statement) while they are stalled in the middle of a statement. A postgres.js client behind a
 * proxy that stops passing the server's answers is such a session: it sent a
 * new statement to be described (Parse, Describe, Flush) and never binds it.
 * The processes that are stopped for real, and the grants and raises that end
 * them, are in test/repo/lock-scope.test.ts.
 */
import { type AddressInfo, connect, createServer, type Server, type Socket } from 'node:net';
import postgres from 'postgres';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { TestDatabase } from '../support/databases.js';
import { scenarioDatabase } from '../support/scenario.js';
import { needs } from '../support/services.js';

// A proxy to Postgres whose answers to the client stop passing once `withhold` is set.
function withholdingProxy(url: string) {
  const state = { withhold: false };
  const sockets = new Set<Socket>();
  const server: Server = createServer((inbound) => {
    const outbound = connect(Number(new URL(url).port || 5432), '127.0.0.1');
    sockets.add(inbound).add(outbound);
    inbound.pipe(outbound);
    outbound.on('data', (chunk: Buffer) => {
      if (!state.withhold) inbound.write(chunk);
    });
    inbound.on('close', () => outbound.destroy());
    outbound.on('close', () => inbound.destroy());
    inbound.on('error', () => {});
    outbound.on('error', () => {});
  });
  return {
    state,
    async url(): Promise<string> {
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      const proxied = new URL(url);
      proxied.host = `127.0.0.1:${(server.address() as AddressInfo).port}`;
      return proxied.toString();
    },
    close() {
      for (const socket of sockets) socket.destroy();
      server.close();
    },
  };
}

describe.runIf(needs('DATABASE_URL'))('a raise of a lock register ends only stalled sharers (real Postgres)', () => {
  let scenario: TestDatabase;
  let observer: postgres.Sql;
  beforeAll(async () => {
    scenario = await scenarioDatabase();
    observer = postgres(scenario.url as string, { max: 1, onnotice: () => {} });
    await observer`insert into palisade.lock_registers (kind, source, namespace, name, fence)
      values ('redis', 'src', 'ns', 'L', 5), ('redis', 'src', 'ns', 'M', 5)`;
  });
  afterAll(async () => {
    await observer?.end({ timeout: 5 });
    await scenario?.close();
  });

  // Opens a transaction through a proxy, runs `inside` in it, then (if `stall`) sends a statement new on
  // the connection with the server's answers held back: the session waits for its client mid-statement.
  async function session(inside: (tx: postgres.ReservedSql) => Promise<unknown>, stall: boolean) {
    const proxy = withholdingProxy(scenario.url as string);
    const client = postgres(await proxy.url(), { max: 1, onnotice: () => {} });
    // A reserved connection rather than `begin`: begin's own rollback after the connection closes would
    // be written to a socket postgres.js has let go of, which throws where nothing can catch it.
    const conn = await client.reserve();
    await conn`begin`;
    await inside(conn);
    let stalled: Promise<unknown> = Promise.resolve();
    if (stall) {
      proxy.state.withhold = true;
      stalled = conn`select ${1}::int as palisade_stalled_marker`.catch(() => {});
    }
    const pid = await waitFor(stall ? 'active' : 'idle in transaction');
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

  // The session in `state` (bounded: 200 looks, 25 ms apart).
  async function waitFor(state: string): Promise<number> {
    for (let i = 0; i < 200; i++) {
      const rows = await observer<{ pid: number }[]>`select pid from pg_stat_activity
        where state = ${state} and pid <> pg_backend_pid() and datname = current_database()
          and backend_xid is not null`;
      if (rows.length === 1 && rows[0]) return rows[0].pid;
      await new Promise((resolve) => setTimeout(resolve, 25));
    }
    throw new Error(`no session ${state}`);
  }

  const endStalled = async (name: string) =>
    Number((await observer`select palisade.end_stalled_sharers('redis', 'src', 'ns', ${name}) as n`)[0]?.n);
  // A claim as palisade keeps one past its statement: the claim, and the tag that names its session.
  const claim = (tx: postgres.ReservedSql, name: string, fence: number) =>
    tx`select palisade.claim_lock('redis', 'src', 'ns', ${name}, ${fence}),
      palisade.tag_claims(jsonb_build_array(palisade.lock_key('redis', 'src', 'ns', ${name})))`;
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
