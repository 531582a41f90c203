import postgres from 'postgres';
import { drizzle } from 'drizzle-orm/postgres-js';
import { sql as dsql } from 'drizzle-orm';
import { fencedRepository } from '../src/repo/repository.js';
import { updateStatements } from '../src/repo/statements.js';
import { describeTable } from '../src/repo/table.js';
import { prepared } from '../src/driver.js';
import { createAccounts, makeAccounts, randomId } from '../bench/lib/tables.js';
const url = 'postgres://postgres@127.0.0.1:5432/test';
const sql = postgres(url, { max: 16, onnotice: () => {}, connection: { synchronous_commit: 'off' } });
const name = 'scratch_wp_cpu';
await createAccounts(sql, name, 10000);
const table = makeAccounts(name);
const db = drizzle(sql) as any;
const repo = fencedRepository(db, table);
const info = describeTable(table as any);
let f = 1_000_000n;
const fencedText = `update ${name} set balance = $1, last_fence = $3 where id = $2 and last_fence < $3`;
const cases: Record<string, () => Promise<unknown>> = {
  raw: () => sql.unsafe(fencedText, [1, randomId(10000), String(f++)], { prepare: true }),
  rawRet: () => sql.unsafe(`${fencedText} returning *`, [1, randomId(10000), String(f++)], { prepare: true }),
  repo: () => repo.update({ id: randomId(10000) }, f++ as any, { balance: 1 }),
  status: () => repo.update({ id: randomId(10000) }, f++ as any, { balance: 1 }, { returning: 'status' }),
  drz: () => { const st = updateStatements(info, [['id', randomId(10000)]], [['balance', 1]], f++, 'reject'); return prepared(db, st.write.key, st.write.build)(st.write.values); },
  drzS: () => { const st = updateStatements(info, [['id', randomId(10000)]], [['balance', 1]], f++, 'reject', 'status'); return prepared(db, st.write.key, st.write.build)(st.write.values); },
  expr: () => repo.update({ id: randomId(10000) }, f++ as any, { balance: dsql`${table.balance} + ${1}` }),
};
const only = process.argv[2];
const conc = Number(process.argv[3] ?? 1);
for (let round = 0; round < 4; round++) {
  for (const [k, fn] of Object.entries(cases)) {
    if (only && only !== 'all' && k !== only) continue;
    const N = 3000;
    const c0 = process.cpuUsage(); const t0 = performance.now();
    let i = 0;
    await Promise.all(Array.from({ length: conc }, async () => { while (i++ < N) await fn(); }));
    const c = process.cpuUsage(c0); const t = performance.now() - t0;
    console.log(round, k, `${((c.user + c.system) / N).toFixed(0)} µs cpu/op`, `${(N / t * 1000).toFixed(0)} ops/s`);
  }
}
await sql.unsafe(`drop table ${name}`);
await sql.end();
