/**
 * The fence source of a Redis lock manager's grants, for lock registers
 * (README, "Two scopes of fencing").
 */

/**
 * @internal The fence source of a grant whose epoch Redis filed under the id of the database it was
 * taken from (what the grant and release scripts reply), or `undefined` for none. Only with `epochs`
 * can fences be told apart at all; there they stay comparable across every change of the Redis data
 * history (a new epoch from that database is above every earlier one), so the source is that
 * database's: `redis-epochs:<its fence_source_id>`, as the epoch was filed — not as the granting manager
 * reads it, which an id changed meanwhile would make two ids for one counter, two registers. A manager
 * with `epochs` takes no fence from an epoch filed under no id (./scripts/grant.ts). Without `epochs`
 * nothing in Redis can name the counter safely (an id kept in a key of its own can be lost while the
 * counter survives), so such leases carry no lock and stay row-scoped.
 */
export const epochSource = (id: string): string | undefined => (id === '' ? undefined : `redis-epochs:${id}`);
