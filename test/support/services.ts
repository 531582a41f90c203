/**
 * The real services a suite may need, each enabled by one variable. Without
 * it the suite is skipped (named once by test/support/global-setup.ts); in
 * CI (CI=true) a missing service fails the run instead.
 */
export const services = {
  postgres: { variable: 'DATABASE_URL', url: process.env.DATABASE_URL },
  redis: { variable: 'REDIS_URL', url: process.env.REDIS_URL },
} as const;

export const hasPostgres = Boolean(services.postgres.url);
export const hasRedis = Boolean(services.redis.url);

/**
 * Marks a suite as needing a service: returns true when it is configured.
 * Use as `describe.runIf(needs('DATABASE_URL'))(…)`; global-setup names
 * the skipped suites from these calls.
 */
export function needs(variable: 'DATABASE_URL' | 'REDIS_URL'): boolean {
  return Boolean(process.env[variable]);
}
