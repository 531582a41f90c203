/**
 * The shape of every fenced write's SQL, compiled the way the repository
 * compiles it. Placeholders are shown by name (`:fence`, `:k0` for the first
 * key column, `:v0` for the first patch value) so the assertions say which
 * value goes where.
 */
import { eq, is, Param, Placeholder, type SQL, sql } from 'drizzle-orm';
import { PgDialect } from 'drizzle-orm/pg-core';
import { describe, expect, it } from 'vitest';
import {
  deleteStatements,
  type Statement,
  updateStatements,
  updateWhereStatement,
  upsertStatement,
} from '../../src/repo/statements.js';
import { describeTable } from '../../src/repo/table.js';
import { accountsTable, linesTable } from './fixtures.js';

const accounts = accountsTable('accounts');
const info = describeTable(accounts);
const lines = describeTable(linesTable('lines'));

/** Compiles like the repository does; `$n` becomes `:name` for placeholders, `$n` stays for inline values. */
function compile(statement: Statement | SQL): { text: string; inline: unknown[] } {
  const query = new PgDialect().sqlToQuery('build' in statement ? statement.build() : statement);
  const inline: unknown[] = [];
  const text = query.sql.replace(/\$(\d+)/g, (_, n: string) => {
    const param = query.params[Number(n) - 1];
    if (is(param, Param) && is(param.value, Placeholder)) return `:${param.value.name}`;
    inline.push(param);
    return `$${inline.length}`;
  });
  return { text: text.replace(/\s+/g, ' '), inline };
}

describe('update statements', () => {
  const statements = updateStatements(info, [['id', 'a']], [['balance', 5]], 7n, 'reject');
  const { text } = compile(statements.write);
  const { text: refusal } = compile(statements.refusal);
  const write =
    'update "accounts" set "balance" = :v0, "last_fence" = :fence ' +
    'where "accounts"."id" = :k0 and "accounts"."deleted_at" is null and "accounts"."last_fence" < :fence ' +
    'returning *, true as palisade_applied';

  it('the success path is the plain fenced UPDATE: key matches, row live, fence lower — nothing else', () => {
    expect(text).toBe(write);
  });

  it('the refusal statement tries the same write again and reads the previous fence beside it', () => {
    expect(refusal).toMatch(
      /^with prev as \(select "accounts"\."last_fence" as fence, "accounts"\."deleted_at" is not null as deleted from "accounts" where "accounts"\."id" = :k0\), w as \(update /,
    );
    expect(refusal).toContain(write);
    // A second data-modifying CTE on the same row would split on deleted_at in the snapshot.
    expect(refusal.match(/update "accounts"/g)).toHaveLength(1);
    expect(refusal).not.toContain('tomb as');
    expect(refusal).toMatch(/select w\.\*, \(select fence from prev\) as "palisade_prev_fence".* left join w on true$/);
  });

  it('both carry the values for their placeholders and are cached by shape, under different keys', () => {
    expect(statements.write.values).toEqual({ fence: 7n, k0: 'a', v0: 5 });
    expect(statements.refusal.values).toBe(statements.write.values);
    expect(statements.write.key).toMatch(
      /^\[null,"accounts",\["id"\],\[\["id","id","text","\d+",false\],\["owner","owner","text","\d+",false\],\["balance","balance","integer","\d+",false\],.*\|update\|reject\|"balance",\|row$/,
    );
    expect(statements.refusal.key).toMatch(/\|update\|reject\|"balance",\|refusal$/);
  });

  it("returning 'status' sends nothing back: the row count says whether the write applied", () => {
    const status = updateStatements(info, [['id', 'a']], [['balance', 5]], 7n, 'reject', 'status');
    expect(compile(status.write).text).toMatch(/"accounts"\."last_fence" < :fence$/);
    expect(status.write.key).toMatch(/\|status$/);
    // Off the success path the row comes back anyway; the repository drops it.
    expect(compile(status.refusal).text).toContain('returning *, true as palisade_applied');
  });

  it("compares with <= under sameFence 'allow'", () => {
    const allow = compile(updateStatements(info, [['id', 'a']], [['balance', 5]], 7n, 'allow').write).text;
    expect(allow).toContain('"accounts"."deleted_at" is null and "accounts"."last_fence" <= :fence returning');
  });

  it("lifts an SQL expression's values into placeholders: cached by the expression's shape", () => {
    const plusOne = updateStatements(info, [['id', 'a']], [['balance', sql`${accounts.balance} + ${1}`]], 7n, 'reject');
    const plusTwo = updateStatements(info, [['id', 'b']], [['balance', sql`${accounts.balance} + ${2}`]], 8n, 'reject');
    const { text: withExpression, inline } = compile(plusOne.write);
    expect(withExpression).toContain('set "balance" = "accounts"."balance" + :v0_0, "last_fence" = :fence');
    expect(inline).toEqual([]);
    expect(plusOne.write.values).toEqual({ fence: 7n, k0: 'a', v0_0: 1 });
    expect(plusTwo.write.values).toEqual({ fence: 8n, k0: 'b', v0_0: 2 });
    expect(plusOne.write.key).toBeDefined();
    expect(plusOne.write.key).toBe(plusTwo.write.key);
    const times = updateStatements(info, [['id', 'a']], [['balance', sql`${accounts.balance} * ${2}`]], 7n, 'reject');
    expect(times.write.key).not.toBe(plusOne.write.key);
  });

  it('an expression whose text is not its shape alone (inlined values, arrays) is compiled per call', () => {
    const inlined = sql`${accounts.balance} + ${1}`.inlineParams();
    const once = updateStatements(info, [['id', 'a']], [['balance', inlined]], 7n, 'reject');
    expect(once.write.key).toBeUndefined();
    expect(compile(once.write).text).toContain('set "balance" = "accounts"."balance" + 1,');
    const array = updateStatements(info, [['id', 'a']], [['balance', sql`least(${[1, 2]})`]], 7n, 'reject');
    expect(array.write.key).toBeUndefined();
    const { text: t, inline } = compile(array.write);
    expect(t).toContain('least(($1, $2))');
    expect(inline).toEqual([1, 2]);
  });
});

describe('upsert statement', () => {
  const statement = upsertStatement(
    info,
    [['id', 'a']],
    [
      ['id', 'a'],
      ['balance', 5],
    ],
    7n,
    'reject',
  );
  const { text } = compile(statement);

  it('inserts with the fence, and on conflict updates only below excluded.last_fence', () => {
    expect(text).toContain(
      'insert into "accounts" ("id", "balance", "last_fence", "deleted_at") select :v0, :v1, :fence, null ' +
        "where set_config('palisade.upsert', 'insert', true) is not null " +
        'and (exists (select 1 from prev) or (select fence from floor) < :fence) ' +
        'on conflict ("id") do update set "balance" = excluded."balance", ',
    );
    expect(text).toContain(
      '"last_fence" = excluded."last_fence", "deleted_at" = null ' +
        'where "accounts"."last_fence" < excluded."last_fence" ' +
        "and set_config('palisade.upsert', 'update', true) is not null returning *, true as \"palisade_applied\", ",
    );
  });

  it("creates a row only above the table's tombstone floor, re-checked with a fresh snapshot after inserting", () => {
    expect(text).toContain(
      `floor as (select coalesce((select f.floor from palisade.tombstone_floors f where f.fenced_table operator(pg_catalog.=) palisade.floor_table('"accounts"'::regclass)), 0) as fence)`,
    );
    expect(text).toContain(
      "case when current_setting('palisade.upsert', true) = 'insert' " +
        'then palisade.check_tombstone_floor(\'"accounts"\'::regclass, :fence, false) end as palisade_floor_checked',
    );
    expect(text).toMatch(
      /\(select fence from floor\) as "palisade_floor" from \(select 1\) as palisade_one left join w on true$/,
    );
  });

  it('keeps columns not given on a live row, defaults them on a tombstone', () => {
    expect(text).toContain(
      '"owner" = case when "accounts"."deleted_at" is null then "accounts"."owner" else excluded."owner" end',
    );
    expect(text).not.toMatch(/"id" = excluded/);
  });

  it('carries the values for its placeholders', () => {
    expect(statement.values).toEqual({ fence: 7n, k0: 'a', v0: 'a', v1: 5 });
  });

  it('names every key column of a composite key', () => {
    const composite = compile(
      upsertStatement(
        lines,
        [
          ['orderId', 'o'],
          ['lineNo', 1],
        ],
        [
          ['orderId', 'o'],
          ['lineNo', 1],
          ['qty', 2],
        ],
        7n,
        'reject',
      ),
    ).text;
    expect(composite).toContain('where "lines"."order_id" = :k0 and "lines"."line_no" = :k1)');
    expect(composite).toContain('on conflict ("order_id", "line_no") do update set "qty" = excluded."qty", ');
  });
});

describe('delete statements', () => {
  const statements = deleteStatements(info, [['id', 'a']], 7n, 'reject');
  const { text } = compile(statements.write);

  it('marks a live row deleted and keeps the fence: a tombstone, never a DELETE; a tombstone is left alone', () => {
    expect(text).toBe(
      'update "accounts" set "deleted_at" = now(), "last_fence" = :fence ' +
        'where "accounts"."id" = :k0 and "accounts"."deleted_at" is null and "accounts"."last_fence" < :fence returning *, true as palisade_applied',
    );
    expect(text).not.toMatch(/delete from/i);
    expect(compile(statements.refusal).text).toContain(`w as (${text})`);
  });
});

describe('updateWhere statement', () => {
  const where = eq(accounts.owner, 'x');

  it("updates the live rows matching the caller's condition below the fence, counting both outcomes", () => {
    const { text, inline } = compile(updateWhereStatement(info, where, [['balance', 0]], 7n, 'reject', false));
    expect(text).toContain(
      'with target as (select "accounts"."id", "accounts"."last_fence" as palisade_fence from "accounts" ' +
        'where ("accounts"."owner" = $1) and "accounts"."deleted_at" is null), ',
    );
    expect(text).toContain(
      'update "accounts" set "balance" = :v0, "last_fence" = :fence ' +
        'where ("accounts"."id") in (select "id" from target) ' +
        'and "accounts"."deleted_at" is null and "accounts"."last_fence" < :fence returning 1)',
    );
    expect(text).toContain(
      'select (select count(*) from w) as applied, (select count(*) from target) - (select count(*) from w) as stale',
    );
    expect(inline).toEqual(['x']);
  });

  it('with allOrNothing, locks the targets and writes none if any is not below the fence', () => {
    const { text } = compile(updateWhereStatement(info, where, [['balance', 0]], 7n, 'reject', true));
    expect(text).toContain('and "accounts"."deleted_at" is null for update), ');
    expect(text).toContain(
      '"accounts"."last_fence" < :fence and not exists (select 1 from target where not (target.palisade_fence < :fence)) returning 1)',
    );
    expect(text).toContain('(select count(*) from target where not (target.palisade_fence < :fence)) as stale');
  });
});
