/**
 * whenIdle (src/node-postgres-client.ts): what a lost lease's stop still sends on a node-postgres client —
 * `ROLLBACK AND CHAIN`, the driver's rollbacks — goes once the client is idle, and never waits for ever
 * on a client that failed while busy (pg then leaves `readyForQuery` false and has already emitted its
 * `error` and `end`: the hang test/repo/lost-lease.test.ts once met under the idle timeout's race).
 * A stand-in client: only the fields and events whenIdle reads.
 */
import { EventEmitter } from 'node:events';
import { describe, expect, it } from 'vitest';
import { type PgClientState, whenIdle } from '../../src/node-postgres-client.js';
import { sleep } from '../support/sleep.js';

class StandIn extends EventEmitter {
  readyForQuery = true;
  _queryable = true;
  _ending = false;
  pipeline = false;
}
const state = (c: StandIn) => c as unknown as PgClientState;

describe('whenIdle', () => {
  it('sends at once on an idle client', async () => {
    const client = new StandIn();
    const sent: string[] = [];
    await whenIdle(state(client), () => sent.push('rollback'));
    expect(sent).toEqual(['rollback']);
  });

  it('on a busy client, sends at its drain — one waiter per drain, the next at the next — and leaves no listener', async () => {
    const client = new StandIn();
    client.readyForQuery = false;
    const sent: string[] = [];
    const send = (what: string) => () => {
      sent.push(what);
      client.readyForQuery = false; // what the client does once handed a statement
    };
    const first = whenIdle(state(client), send('rollback and chain'));
    const second = whenIdle(state(client), send('rollback'));
    await sleep(10);
    expect(sent).toEqual([]);
    client.readyForQuery = true;
    client.emit('drain');
    await first;
    expect(sent).toEqual(['rollback and chain']);
    client.readyForQuery = true;
    client.emit('drain');
    await second;
    expect(sent).toEqual(['rollback and chain', 'rollback']);
    for (const event of ['drain', 'end', 'error']) expect(client.listenerCount(event)).toBe(0);
  });

  it('on a client that failed while busy, after its events were emitted, sends anyway (answered at once, not queryable)', async () => {
    const client = new StandIn();
    client.readyForQuery = false;
    client._queryable = false; // failed, and nothing more will be emitted
    const sent: string[] = [];
    await whenIdle(state(client), () => sent.push('rollback'));
    expect(sent).toEqual(['rollback']);
  });

  it('notices a client that failed while it waited even with no event, by looking again', async () => {
    const client = new StandIn();
    client.readyForQuery = false;
    const sent: string[] = [];
    const waiting = whenIdle(state(client), () => sent.push('rollback'));
    await sleep(10);
    expect(sent).toEqual([]);
    client._queryable = false; // no event follows
    await waiting;
    expect(sent).toEqual(['rollback']);
    for (const event of ['drain', 'end', 'error']) expect(client.listenerCount(event)).toBe(0);
  });

  it('a send that throws rejects the wait', async () => {
    const boom = new Error('boom');
    await expect(
      whenIdle(state(new StandIn()), () => {
        throw boom;
      }),
    ).rejects.toBe(boom);
  });
});
