/**
 * A Postgres database of its own for one test, bench run or chaos run:
 * created on the server `baseUrl` points at, dropped (with force) at the
 * end, so runs go in parallel and twice in a row without seeing each other.
 */
import { randomBytes } from 'node:crypto';
import postgres from 'postgres';

export interface ScratchDatabase {
  readonly name: string;
  /** `baseUrl` with this database's name. */
  readonly url: string;
  /** Drops the database (with force: open sessions are ended). Safe to call twice. */
  drop(): Promise<void>;
  /** Leaves the database in place (to look at after a failed run) and closes the admin connection. */
  keep(): Promise<void>;
}

/**
 * Creates `<prefix>_<random>` on the server of `baseUrl`: empty, or a copy of the database `template`
 * (which no session may be connected to). Does not migrate it.
 */
export async function createScratchDatabase(
  baseUrl: string,
  prefix = 'palisade_t',
  template?: string,
): Promise<ScratchDatabase> {
  const name = `${prefix}_${randomBytes(6).toString('hex')}`;
  const admin = postgres(baseUrl, { max: 1, onnotice: () => {} });
  try {
    await admin.unsafe(
      template === undefined ? `create database ${name}` : `create database ${name} template ${template}`,
    );
  } catch (err) {
    await admin.end({ timeout: 5 });
    throw err;
  }
  let done = false;
  return {
    name,
    url: withDatabase(baseUrl, name),
    async drop() {
      if (done) return;
      done = true;
      await admin.unsafe(`drop database if exists ${name} with (force)`);
      await admin.end({ timeout: 5 });
    },
    async keep() {
      if (done) return;
      done = true;
      await admin.end({ timeout: 5 });
    },
  };
}

/** `url` with its database name replaced by `name`. */
export function withDatabase(url: string, name: string): string {
  const u = new URL(url);
  u.pathname = `/${name}`;
  return u.toString();
}
