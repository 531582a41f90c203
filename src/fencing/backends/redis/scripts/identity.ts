/**
 * The Lua functions every script that issues or installs fences starts with:
 * the data history the server's keys belong to, and whether the server is
 * recent enough for that history to be told apart by it.
 */

// The data history the server's keys belong to, as the script sees it (never
// a client's cached value): `master_replid`, or false unless the server is a
// primary. Why this names a history:
// - the fence state only ever changes forward on one primary's dataset
//   (HINCRBY), so a state whose id is the current identity was written on
//   the dataset the server holds now, with every fence it ever issued;
// - a dataset is replaced or forked only by a restart, by a flush (the
//   state is gone) or by replication. A primary draws a new random
//   master_replid at every start, even one that reloads an older RDB or AOF
//   (Redis ≥ 6.2 restores the id it saved only on a replica, and a primary's
//   only as master_replid2 — see MIN_VERSION_LUA). A promotion — failover,
//   failback, REPLICAOF NO ONE — draws a new one too;
// - a replica reports its primary's master_replid, and its copy of the
//   fence state (behind the primary's when it lags) carries that very id:
//   the role check alone keeps it from granting, writable or not. So the
//   role is read from the section's first line, and the id from the last
//   master_replid line: the lines between carry text an operator or a
//   replica chose (a primary's host name, a replica's announced address),
//   which could otherwise pass for either;
// - so the old primary of a failback (R's dataset after the resync, a new
//   replid after its promotion), a promoted replica (its primary's state)
//   and a restarted primary all see a foreign id and take a new epoch.
// Not covered: an in-place reload (DEBUG RELOAD of an older file) and hand
// edits of palisade's keys keep the identity. `INFO server` (run_id) is not
// read on the grant path: it cost a grant about a third of its server time.
/** @internal Lua: `identity()` → `master_replid`, or false on a replica. */
export const IDENTITY_LUA = `
local function identity()
  local replication = redis.call('INFO', 'replication')
  if string.sub(replication, 1, 28) ~= '# Replication\\r\\nrole:master\\r\\n' then return false end
  -- Plain finds (a pattern scan of the whole INFO text costs more); Redis's own lines follow the last.
  local at, from = nil, 1
  while true do
    local found = string.find(replication, '\\r\\nmaster_replid:', from, true)
    if not found then break end
    at, from = found, found + 16
  end
  return at and string.match(replication, '^%x+', at + 16) or false
end
`;

/** The oldest Redis (`redis_version`, major.minor) that palisade issues fences on. */
export const REDIS_MIN_VERSION = '6.2';

// Whether the server is at least ARGV-given `major.minor`: an older one may
// restore a primary's master_replid from its RDB at start (4.0.0 did), so a
// restart that reloads an older file could keep the identity. Checked only
// where a fence state gets its id (a new epoch), so every state a grant
// issues from was written on a server that passed it.
/** @internal Lua: `recent_enough(min)` → true, or the server's version string. */
export const MIN_VERSION_LUA = `
local function recent_enough(min)
  -- The section's second line, before any text a user chose (paths, names).
  local version = string.match(redis.call('INFO', 'server'), '^# Server\\r\\nredis_version:([%d.]+)') or '?'
  local major, minor = string.match(version, '^(%d+)%.(%d+)')
  local want_major, want_minor = string.match(min, '^(%d+)%.(%d+)')
  if not major then return version end
  major, minor, want_major, want_minor = tonumber(major), tonumber(minor), tonumber(want_major), tonumber(want_minor)
  if major > want_major or (major == want_major and minor >= want_minor) then return true end
  return version
end
`;
