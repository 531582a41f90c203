/**
 * The Lua function every script that issues or installs fences starts with:
 * the data history the server's keys belong to.
 */

// The data history the server's keys belong to, as the script sees it (never
// a client's cached value): `run_id/master_replid`, or false unless the
// server is a primary. Why this names a history, not a process:
// - the fence state only ever changes forward on one primary's dataset
//   (HINCRBY), so a state whose id is the current identity was written on
//   the dataset the server holds now, with every fence it ever issued;
// - a dataset is replaced or forked only by a restart (a new process:
//   run_id changes, even when it reloads an older RDB/AOF), by a flush (the
//   state is gone) or by replication: a server that follows another (full or
//   partial resync) takes its primary's master_replid and, being a replica,
//   grants nothing (role check: a replica reports its primary's replid, and
//   even a writable replica's keys are not its primary's); a promotion —
//   failover, failback, REPLICAOF NO ONE — draws a new random master_replid;
// - so the old primary of a failback (same process, same run_id, but R's
//   dataset after the resync and a new replid after its promotion) and a
//   promoted replica (its primary's state, its own run_id) both see a
//   foreign id and take a new epoch.
// Not covered: an in-place reload (DEBUG RELOAD of an older file) and hand
// edits of palisade's keys keep the identity. Two INFO sections (Redis 6
// has no multi-section INFO); the lock and queue paths never call it.
/** @internal Lua: `identity()` → `run_id/master_replid`, or false on a replica. */
export const IDENTITY_LUA = `
local function identity()
  local replication = redis.call('INFO', 'replication')
  if not string.find(replication, 'role:master', 1, true) then return false end
  local server = redis.call('INFO', 'server')
  -- Plain finds, then a match anchored where the value starts: a pattern scan of the whole INFO text
  -- cost three times both INFO calls together.
  local r = string.find(replication, 'master_replid:', 1, true)
  local s = string.find(server, 'run_id:', 1, true)
  local replid = r and string.match(replication, '^%x+', r + 14)
  local run = s and string.match(server, '^%x+', s + 7)
  if not replid or not run then return false end
  return run .. '/' .. replid
end
`;
