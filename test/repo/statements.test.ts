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
  deleteStatement,
  type Statement,
  updateStatement,
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

describe('update statement', () => {
  const statement = updateStatement(info, [['id', 'a']], [['balance', 5]], 7n, 'reject');
  const { text } = compile(statement);

  it('sets the patch and the fence only where the key matches, the row is live and its fence is lower', () => {
    expect(text).toContain(
      'update "accounts" set "balance" = :v0, "last_fence" = :fence ' +
        'where "accounts"."id" = :k0 and "accounts"."deleted_at" is null and "accounts"."last_fence" < :fence ' +
        'returning *, true as palisade_applied',
    );
  });

  it('reads the previous fence in the same statement; one UPDATE decides, nothing else writes the row', () => {
    expect(text).toMatch(
      /^with prev as \(select "accounts"\."last_fence" as fence, "accounts"\."deleted_at" is not null as deleted from "accounts" where "accounts"\."id" = :k0\), w as \(update /,
    );
    // A second data-modifying CTE on the same row would split on deleted_at in the snapshot.
    expect(text.match(/update "accounts"/g)).toHaveLength(1);
    expect(text).not.toContain('tomb as');
    expect(text).toMatch(/select w\.\*, \(select fence from prev\) as "palisade_prev_fence".* left join w on true$/);
  });

  it('carries the values for its placeholders and is cached by shape', () => {
    expect(statement.values).toEqual({ fence: 7n, k0: 'a', v0: 5 });
    expect(statement.key).toMatch(
      /^accounts\|id=id:text,owner=owner:text,balance=balance:integer,.*\|update\|reject\|balance$/,
    );
  });

  it("compares with <= under sameFence 'allow'", () => {
    const allow = compile(updateStatement(info, [['id', 'a']], [['balance', 5]], 7n, 'allow')).text;
    expect(allow).toContain('"accounts"."deleted_at" is null and "accounts"."last_fence" <= :fence returning');
  });

  it('inlines an SQL expression and is then never cached', () => {
    const expression = updateStatement(
      info,
      [['id', 'a']],
      [['balance', sql`${accounts.balance} + ${1}`]],
      7n,
      'reject',
    );
    const { text: withExpression, inline } = compile(expression);
    expect(withExpression).toContain('set "balance" = "accounts"."balance" + $1, "last_fence" = :fence');
    expect(inline).toEqual([1]);
    expect(expression.key).toBeUndefined();
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
        'where exists (select 1 from prev) or (select fence from floor) < :fence ' +
        'on conflict ("id") do update set "balance" = excluded."balance", ',
    );
    expect(text).toContain(
      '"last_fence" = excluded."last_fence", "deleted_at" = null ' +
        'where "accounts"."last_fence" < excluded."last_fence" returning *, true as "palisade_applied", ',
    );
  });

  it("creates a row only above the table's tombstone floor, re-checked with a fresh snapshot after inserting", () => {
    expect(text).toContain(
      'floor as (select coalesce((select f.floor from palisade.tombstone_floors f where f.table_name = :floorTable), 0) as fence)',
    );
    expect(text).toContain(
      'case when xmax = 0 then palisade.check_tombstone_floor(:floorTable, :fence, false) end as palisade_floor_checked',
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
    expect(statement.values).toEqual({ fence: 7n, floorTable: 'accounts', k0: 'a', v0: 'a', v1: 5 });
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

describe('delete statement', () => {
  const { text } = compile(deleteStatement(info, [['id', 'a']], 7n, 'reject'));

  it('marks a live row deleted and keeps the fence: a tombstone, never a DELETE; a tombstone is left alone', () => {
    expect(text).toContain(
      'update "accounts" set "deleted_at" = now(), "last_fence" = :fence ' +
        'where "accounts"."id" = :k0 and "accounts"."deleted_at" is null and "accounts"."last_fence" < :fence returning *',
    );
    expect(text).not.toMatch(/delete from/i);
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
