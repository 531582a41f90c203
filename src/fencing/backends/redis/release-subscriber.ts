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
 * @internal What a handoff message carries for the waiter it names: its fence, as the script replied it,
 * and the id its epoch is filed under ('' for an epoch activated by an earlier version).
 */
export interface HandedOver {
  readonly epoch: string;
  readonly counter: string;
  readonly source: string;
}

/**
 * @internal The listener of `channel`: a message `name` wakes every waiter of
 * the name; `name\0sha1(token)` wakes that waiter (the head of the line,
 * listening as `name\0sha1(token)`) and waiters that gave no token;
 * `name\0sha1(token)\0epoch\0counter` also hands that waiter its grant.
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
        return;
      }
      const name = message.slice(0, cut);
      const parts = message.slice(cut + 1).split('\0');
      const head = `${name}\0${parts[0]}`;
      // A handoff names hash, epoch, counter and the id the epoch is filed under. An earlier version's has no
      // id: a plain wake-up here, so the waiter's next grant (same token) reads the epoch's id in Redis.
      if (parts.length === 4) {
        const handed: HandedOver = {
          epoch: parts[1] as string,
          counter: parts[2] as string,
          source: parts[3] as string,
        };
        onReleased(head, undefined, handed); // the head of the line, with its grant …
      } else {
        onReleased(head); // … or only woken
      }
      onReleased(name); // and waiters that gave no token
    });
    // Closed while Redis is away: give up on the queued SUBSCRIBE. disconnect() does not always
    // settle it: during ioredis's wait before a reconnect no 'close' follows, and the offline
    // queue is never flushed, so the abort itself ends the wait.
    const aborted = new Promise<never>((_, reject) => {
      closing.addEventListener(
        'abort',
        () => {
          subscriber.disconnect();
          reject(closing.reason);
        },
        { once: true },
      );
    });
    const subscribed = subscriber.subscribe(channel);
    subscribed.catch(() => {}); // after an abort nobody awaits it
    try {
      await Promise.race([subscribed, aborted]);
    } catch (err) {
      subscriber.disconnect();
      throw err;
    }
    return async () => subscriber.disconnect();
  });
}
