import { type AddressInfo, connect, createServer, type Server, type Socket } from 'node:net';

/**
 * A loopback proxy to Postgres that stalls its clients the ways a network
 * (or a paused peer) does, each switched on in `state`:
 *
 * - `withhold`: the server's answers are held back; the client, waiting for
 *   them, sends nothing more, and a session that began a statement waits
 *   for its client mid-statement (`ClientRead`);
 * - `stopReading`: the proxy stops reading the server's answers at all; the
 *   server, once the socket buffers are full, waits to write a large result
 *   (`ClientWrite`);
 * - `splitAfterParse`: of what the client sends next, the first Parse
 *   message goes through and everything after it is held back, as a link
 *   that splits a statement's messages does (the server parses, then waits
 *   for the Bind: `ClientRead`);
 * - `splitAfterBind`: the same, up to the end of the first Bind message (the
 *   server binds the statement — and takes its snapshot — then waits for the
 *   Execute).
 *
 * `release()` switches all of them off and delivers what was held back, in
 * order: the stalled session goes on as if the link had only been slow.
 */
export function withholdingProxy(url: string) {
  const state = { withhold: false, stopReading: false, splitAfterParse: false, splitAfterBind: false };
  const toClient: (() => void)[] = [];
  const toServer: (() => void)[] = [];
  const sockets = new Set<Socket>();
  const outbounds = new Set<Socket>();
  let splits = 0;
  const server: Server = createServer((inbound) => {
    const outbound = connect(Number(new URL(url).port || 5432), '127.0.0.1');
    sockets.add(inbound).add(outbound);
    outbounds.add(outbound);
    let split = false;
    inbound.on('data', (chunk: Buffer) => {
      if (split) {
        toServer.push(() => outbound.write(chunk));
        return;
      }
      if (!state.splitAfterParse && !state.splitAfterBind) {
        outbound.write(chunk);
        return;
      }
      // After the startup packet every chunk the client writes starts at a message: walk them.
      const end = endOfFirst(chunk, state.splitAfterParse ? PARSE : BIND);
      if (end === undefined) {
        outbound.write(chunk);
        return;
      }
      split = true;
      splits++;
      outbound.write(chunk.subarray(0, end));
      const rest = chunk.subarray(end);
      toServer.push(() => {
        split = false;
        outbound.write(rest);
      });
    });
    outbound.on('data', (chunk: Buffer) => {
      if (state.stopReading) outbound.pause();
      if (state.withhold || state.stopReading) toClient.push(() => inbound.write(chunk));
      else inbound.write(chunk);
    });
    inbound.on('close', () => outbound.destroy());
    outbound.on('close', () => inbound.destroy());
    inbound.on('error', () => {});
    outbound.on('error', () => {});
  });
  return {
    state,
    /** How many statements were split so far. */
    get splits() {
      return splits;
    },
    /** Starts listening; the URL to give the client (the proxy's loopback port in place of Postgres'). */
    async url(): Promise<string> {
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      const proxied = new URL(url);
      proxied.host = `127.0.0.1:${(server.address() as AddressInfo).port}`;
      return proxied.toString();
    },
    /** Ends every stall and delivers, in order, what was held back either way. */
    release() {
      state.withhold = false;
      state.stopReading = false;
      state.splitAfterParse = false;
      state.splitAfterBind = false;
      for (const deliver of toServer.splice(0)) deliver();
      for (const deliver of toClient.splice(0)) deliver();
      for (const outbound of outbounds) outbound.resume();
    },
    /** Resets every client's connection (a TCP RST, as a network or a dying peer sends): the client reads ECONNRESET. */
    reset() {
      for (const socket of sockets) if (!outbounds.has(socket)) socket.resetAndDestroy();
    },
    close() {
      for (const socket of sockets) socket.destroy();
      server.close();
    },
  };
}

const PARSE = 0x50; // 'P'
const BIND = 0x42; // 'B'

// The offset just past the first message of `type` (its type byte, then its length, which counts itself)
// in a chunk of whole frontend messages; undefined when the chunk holds none.
function endOfFirst(chunk: Buffer, type: number): number | undefined {
  for (let at = 0; at + 5 <= chunk.length; ) {
    const end = at + 1 + chunk.readUInt32BE(at + 1);
    if (chunk[at] === type) return end;
    at = end;
  }
  return undefined;
}
