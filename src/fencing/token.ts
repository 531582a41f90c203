/**
 * Lock tokens: 128 random bits, hex. Cut from a pool of random bytes drawn
 * 4 KiB at a time, so a grant does not pay a `randomBytes` call (and its
 * buffer) per token; each token is still 16 bytes that no other token uses.
 */
import { randomBytes } from 'node:crypto';

const TOKEN_BYTES = 16;
const TOKENS_PER_DRAW = 256;
const HEX_PER_TOKEN = TOKEN_BYTES * 2;

let pool = '';
let next = 0;

/** @internal A fresh token: 32 hex characters of cryptographic randomness, never handed out twice by this process. */
export function newToken(): string {
  if (next >= pool.length) {
    pool = randomBytes(TOKEN_BYTES * TOKENS_PER_DRAW).toString('hex');
    next = 0;
  }
  const token = pool.slice(next, next + HEX_PER_TOKEN);
  next += HEX_PER_TOKEN;
  return token;
}
