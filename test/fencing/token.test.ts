import { describe, expect, it } from 'vitest';
import { newToken } from '../../src/fencing/token.js';

describe('lock tokens', () => {
  it('are 32 hex characters and never repeat across several pool refills', () => {
    const seen = new Set<string>();
    for (let i = 0; i < 2_000; i++) {
      const token = newToken();
      expect(token).toMatch(/^[0-9a-f]{32}$/);
      seen.add(token);
    }
    expect(seen.size).toBe(2_000);
  });
});
