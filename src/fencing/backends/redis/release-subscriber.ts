/**
 * Wakes waiters when the release script publishes a lock name: one
 * subscriber connection per manager (a subscribed connection can run nothing
 * else), opened at the first wait. Never needed for correctness: every wait
 * also ends at its timeout.
 */
import type { Cluster, Redis } from 'ioredis';
import { ReleaseListener } from '../../release-listener.js';
import type { RedisClient } from './options.js';

/**
 * @internal The listener of `channel`: a message `name` wakes every waiter of
 * the name; `name\0token` wakes that waiter (the head of the line) and
 * waiters that gave no token.
 */
export function releaseSubscriber(redis: RedisClient, channel: string): ReleaseListener {
  return new ReleaseListener(async (onReleased, closing) => {
    // An offline queue here is harmless: nothing awaits it, disconnect() flushes it.
    const subscriber = redis.isCluster
      ? (redis as Cluster).duplicate([], { enableOfflineQueue: true }) // same startup nodes; PUBLISH reaches every node
      : (redis as Redis).duplicate({ enableOfflineQueue: true, autoResubscribe: false, lazyConnect: false });
    subscriber.on('error', () => {}); // reconnects by itself; waits fall back to their timeouts meanwhile
    if (!redis.isCluster) {
      // ioredis's own autoResubscribe sends SUBSCRIBE after a reconnect without handling its
      // rejection: a close() right then left an unhandled "Connection is closed." behind.
      let reconnecting = false;
      subscriber.on('close', () => {
        reconnecting = true;
      });
      subscriber.on('ready', () => {
        if (reconnecting) (subscriber as Redis).subscribe(channel).catch(() => {});
      });
    }
    subscriber.on('message', (from: string, message: string) => {
      if (from !== channel) return;
      const cut = message.indexOf('\0');
      if (cut < 0) {
        onReleased(message, `${message}\0`); // no live waiter in line: wake every waiter of the name
      } else {
        onReleased(message); // the head of the line (name\0token) …
        onReleased(message.slice(0, cut)); // … and waiters that gave no token
      }
    });
    // Closed while Redis is away: disconnect() rejects the queued SUBSCRIBE instead of leaving it pending.
    closing.addEventListener('abort', () => subscriber.disconnect(), { once: true });
    try {
      await subscriber.subscribe(channel);
    } catch (err) {
      subscriber.disconnect();
      throw err;
    }
    return async () => subscriber.disconnect();
  });
}
