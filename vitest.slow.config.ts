import { defineConfig } from 'vitest/config';

// The slow suite (`npm run test:slow`): tests that drive a real browser or run for minutes, and every property
// of test/property at its full count (`npm test` runs them at a fifth: test/property/support.ts). Not part of `npm test`.
export default defineConfig({
  test: {
    include: ['test-slow/**/*.test.ts', 'test/property/**/*.test.ts'],
    globalSetup: ['test/support/global-setup.ts'],
    testTimeout: 300_000,
    hookTimeout: 300_000,
    pool: 'forks',
    maxWorkers: 1,
    env: { PALISADE_PROPERTY_SCALE: process.env.PALISADE_PROPERTY_SCALE ?? '1' },
  },
});
