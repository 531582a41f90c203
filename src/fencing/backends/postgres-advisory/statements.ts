/**
 * The advisory backend's SQL, each one statement on the lease's own session.
 * A grant labels its session's `application_name`
 * `pl:<fence>:<acquired ms>:<holder>`, which is what `inspect` reads back
 * beside `pg_locks`: at most 63 printable ASCII bytes, so a holder label
 * comes back truncated, with other characters as `?`; the fence and time
 * are exact, and nothing needs cleaning up — it vanishes with the session.
 */
import { RELEASE_CHANNEL } from '../../release-listener.js';

/** `pl:<fence>:<ms>:` then `-` (no holder) or `=` and the holder label. */
export const LABEL = /^pl:([1-9][0-9]{0,18}):([0-9]{1,16}):(?:-|=(.*))$/s;
const APP_NAME_BYTES = 63;
export const IDLE_APP_NAME = 'palisade';

/** What the grant statement begins with: `inspect` tells a session still in it (locked, not yet labelled). */
const GRANT_MARK = '/* palisade advisory grant */';

// The lock, the fence, the label and the idle timeout in one statement.
// MATERIALIZED: the try-lock runs exactly once (a second call would take the
// re-entrant lock twice); CASE draws a fence only when the lock was taken.
// The try-lock never waits, but nextval does while another transaction holds
// a lock on the sequence (an ALTER SEQUENCE not yet committed): `w` sets this
// attempt's lock_timeout first ($4: what is left of the acquire's wait; the
// sequence is locked when nextval runs, after it), and the last column puts
// the session's own bound back ($5). The grant claims its lock's register in
// the same statement (palisade.register_grant, migrations 0005 and 0012; $6
// namespace, $7 name) under the fence source id read once the lock is held
// (palisade.granting_source_id: not in this statement's snapshot, taken when
// it was bound), which it returns for the lease to name, waiting at most the same lock_timeout for a fenced transaction
// that holds it: a timeout there is "not granted", as for the sequence. A statement that fails after the
// try-lock leaves the advisory lock held (advisory locks ignore rollback):
// the session is then ended, which frees it.
export const GRANT = `${GRANT_MARK}
  with w as materialized (select set_config('lock_timeout', $4::text, false) as lt),
  t as materialized (select pg_try_advisory_lock($1::int8) as got from w),
  f0 as materialized (
    select got, case when got then nextval('palisade.fence_seq') end as fence,
           floor(extract(epoch from clock_timestamp()) * 1000)::int8 as at,
           case when got then palisade.granting_source_id() end as source
    from t
  ),
  f as materialized (
    select got, fence, at, source,
           case when got then palisade.register_grant('advisory', source, $6::text, $7::text, fence) end as registered
    from f0
  )
  select got, fence::text as fence, source,
         case when got then set_config('application_name',
           left('pl:' || fence || ':' || at || ':' || $3::text, ${APP_NAME_BYTES}), false) end as label,
         case when got then set_config('idle_session_timeout', $2::text, false) end as idle,
         set_config('lock_timeout', $5::text, false) as lock_timeout
  from f`;

export const EXTEND = `
  with h as materialized (
    select exists (
      select 1 from pg_catalog.pg_locks
      where locktype = 'advisory' and pid = pg_backend_pid()
        and classid = $1::oid and objid = $2::oid and objsubid = 1 and granted
    ) as held
  )
  select held, case when held then set_config('idle_session_timeout', $3::text, false) end as idle from h`;

export const RELEASE = `
  with u as materialized (select pg_advisory_unlock($1::int8) as released)
  select released,
         set_config('idle_session_timeout', '0', false) as idle,
         set_config('application_name', '${IDLE_APP_NAME}', false) as app,
         case when released then pg_notify('${RELEASE_CHANNEL}', $2::text)::text end as notified
  from u`;

// The holder's label, and whether its session is still in the grant statement that labels it (between the
// lock and the label come the fence and the register's claim, which may wait on a fenced transaction).
export const INSPECT = `
  select a.application_name as label,
         a.state = 'active' and starts_with(a.query, '${GRANT_MARK}') as granting
  from pg_catalog.pg_locks l
  left join pg_catalog.pg_stat_activity a on a.pid = l.pid
  where l.locktype = 'advisory' and l.granted and l.objsubid = 1
    and l.classid = $1::oid and l.objid = $2::oid
    and l.database = (select oid from pg_catalog.pg_database where datname = current_database())`;

/** The holder label as it fits `application_name`: printable ASCII, truncated with the rest of the label. */
export function holderLabel(holder: string | null): string {
  return holder === null ? '-' : `=${holder.replace(/[^\x20-\x7e]/g, '?')}`;
}
