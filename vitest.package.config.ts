import { defineConfig } from 'vitest/config';

// `npm run test:package`: packs the library and installs it into fresh apps (slow; CI runs it after `npm test`).
export default defineConfig({
  test: {
    include: ['test/package/**/*.package.ts'],
    globalSetup: ['test/support/global-setup.ts'],
    testTimeout: 400_000,
    hookTimeout: 300_000,
    pool: 'forks',
    maxWorkers: 1,
  },
});
