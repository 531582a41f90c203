/**
 * How a lock-scoped write claims its lock's register in its own statement
 * (README, "Two scopes of fencing"): the condition statements.ts adds to
 * the write, and the values of its placeholders. The register's SQL is in
 * migrations 0005–0007.
 */
import { type Param, type SQL, sql } from 'drizzle-orm';
import type { LockIdentity } from '../fencing/lock-identity.js';
import { registerKey } from './register-key.js';

/**
 * How one write claims its lock's register: `claim` shares a register
 * already at its fence, else raises it (or names the higher fence) through
 * `palisade.claim_lock`; `shared` only shares a register already at its
 * fence, found by its key — one parameter instead of four — and writes
 * nothing otherwise (the refusal path then claims). `shared` is for a lock
 * this process has seen claimed at this fence.
 */
export interface Claim {
  readonly lock: LockIdentity;
  readonly shared: boolean;
}

/**
 * True when the lock is claimed for the statement's fence (`fence`, its
 * parameter). Where the register already holds this fence (the grant
 * claimed it, or an earlier write did), a sub-select shares its row (`FOR
 * SHARE`: a raise waits for this transaction) without a function call. After waiting for a raise in
 * progress, the sub-select re-checks the newest row version and finds it no
 * longer at this fence. `shared`: that sub-select alone, by the register's
 * key (`lkey`). Otherwise (by `lk`…`lname`) `palisade.claim_lock` (migration
 * 0005) decides what the sub-select did not: it raises the register, or
 * names the higher fence that refuses.
 */
export function claimGuard(fence: Param, shared: boolean): SQL {
  if (shared) {
    return sql`exists (select 1 from palisade.lock_registers palisade_register
    where palisade_register.lock_key = ${sql.placeholder('lkey')}::uuid and palisade_register.fence = ${fence} for share)`;
  }
  const text = (name: string) => sql`${sql.placeholder(name)}::text`;
  const [lk, ls, ln, lname] = [text('lk'), text('ls'), text('ln'), text('lname')];
  return sql`(exists (select 1 from palisade.lock_registers palisade_register
    where palisade_register.kind = ${lk} and palisade_register.source = ${ls} and palisade_register.namespace = ${ln}
      and palisade_register.name = ${lname} and palisade_register.fence = ${fence} for share)
    or palisade.claim_lock(${lk}, ${ls}, ${ln}, ${lname}, ${fence}) = ${fence})`;
}

/** Fills the placeholders {@link claimGuard} uses for `claim`. */
export function claimValues(values: Record<string, unknown>, { lock, shared }: Claim): void {
  if (shared) {
    values.lkey = registerKey(lock);
    return;
  }
  values.lk = lock.kind;
  values.ls = lock.source;
  values.ln = lock.namespace;
  values.lname = lock.name;
}
