/** Free loopback ports for servers that tests, bench and scripts start themselves. */
import { createServer, type Server } from 'node:net';

/**
 * `count` distinct TCP ports that were free on 127.0.0.1 a moment ago (the
 * OS picks them; all are held open together so none repeats). Another
 * process could still take one before our server binds it: rare on loopback.
 */
export async function freePorts(count: number): Promise<number[]> {
  const servers: Server[] = [];
  try {
    const ports: number[] = [];
    for (let i = 0; i < count; i++) {
      const server = createServer();
      servers.push(server);
      ports.push(await listenOnLoopback(server));
    }
    return ports;
  } finally {
    await Promise.all(servers.map((s) => new Promise((resolve) => s.close(resolve))));
  }
}

/** One free loopback port (see {@link freePorts}). */
export async function freePort(): Promise<number> {
  const [port] = await freePorts(1);
  if (port === undefined) throw new Error('no free port');
  return port;
}

/** Starts `server` on a free loopback port and returns the port. */
export async function listenOnLoopback(server: Server): Promise<number> {
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => resolve());
  });
  const address = server.address();
  if (address === null || typeof address === 'string') throw new Error('no TCP address');
  return address.port;
}
