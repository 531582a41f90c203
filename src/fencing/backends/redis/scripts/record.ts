/**
 * The value of a lock key: the owner's token followed by its grant record,
 * in one string, so a lock and what `inspect` shows are set, expire and go
 * together (one key per held lock; a grant writes one key, a release deletes
 * one, and eviction cannot take the record and leave the lock).
 *
 * `token \0 epoch \0 counter \0 at \0 handoff \0 holder`:
 * - `at`: the grant's Redis `TIME` in ms;
 * - `handoff`: `1` while a lock handed over by a release awaits the waiter's
 *   confirmation, else empty;
 * - `holder`: empty for none, else `=` followed by the label (the last field:
 *   a label may hold any byte).
 *
 * The token ends at the first NUL: the backend refuses a token with a NUL
 * (../backend.ts), so a stored token is exactly the text before it. A value
 * without a NUL (a lock an older palisade set) parses as a token with no
 * record: held, by someone else.
 */

/** @internal Lua: `token_of(value)`, `record_of(value)` → token, epoch, counter, at, handoff, holder (nil if malformed), `record(…)`. */
export const RECORD_LUA = `
local function token_of(v)
  local cut = string.find(v, '\\0', 1, true)
  if cut then return string.sub(v, 1, cut - 1) end
  return v
end
local function record_of(v)
  return string.match(v, '^([^%z]*)%z(%d+)%z(%d+)%z(%d+)%z(1?)%z(.*)$')
end
local function record(token, epoch, counter, at, handoff, holder)
  return token .. '\\0' .. epoch .. '\\0' .. counter .. '\\0' .. at .. '\\0' .. handoff .. '\\0' .. holder
end
`;
