import { defineConfig } from 'vitest/config';

// The slow suite (`npm run test:slow`): tests that drive a real browser or run for minutes. Not part of `npm test`.
export default defineConfig({
  test: {
    include: ['test-slow/**/*.test.ts'],
    globalSetup: ['test/support/global-setup.ts'],
    testTimeout: 300_000,
    hookTimeout: 300_000,
    pool: 'forks',
    maxWorkers: 1,
  },
});
