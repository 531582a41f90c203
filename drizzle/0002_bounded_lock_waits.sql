-- Custom SQL migration: the Postgres lease backend's four statements as functions, so that
-- each can bound its own lock waits on the server. lock_timeout must be set before the
-- statement that touches palisade.leases starts: its table lock is taken when the statement
-- is planned, before anything in it runs. Inside a function, the body's statements are
-- planned and locked when they run, after the set_config. Still one statement, one round
-- trip per primitive; the setting is local and restored, so a caller's transaction keeps its own.
CREATE OR REPLACE FUNCTION "palisade"."lease_grant"(p_ns text, p_name text, p_token text, p_holder text, p_ttl_ms float8, p_lock_wait_ms integer)
RETURNS TABLE (granted_fence text) LANGUAGE plpgsql VOLATILE AS $palisade$
DECLARE
  previous text := current_setting('lock_timeout');
BEGIN
  PERFORM set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::text, true);
  -- Insert the lock's first row, or take over the row if it is expired (or released) or
  -- already ours (a re-sent grant: same fence). CASE evaluates nextval() only on the branch taken.
  RETURN QUERY
  WITH inserted AS (
    INSERT INTO palisade.leases AS l (namespace, name, token, holder, fence, acquired_at, expires_at)
    SELECT p_ns, p_name, p_token, p_holder, nextval('palisade.fence_seq'), c.t, c.t + p_ttl_ms * interval '1 millisecond'
    FROM (SELECT clock_timestamp() AS t) c
    WHERE NOT EXISTS (SELECT 1 FROM palisade.leases x WHERE x.namespace = p_ns AND x.name = p_name)
    ON CONFLICT (namespace, name) DO NOTHING
    RETURNING l.fence
  ), taken AS (
    UPDATE palisade.leases l SET
      fence = CASE WHEN l.token = p_token THEN l.fence ELSE nextval('palisade.fence_seq') END,
      acquired_at = CASE WHEN l.token = p_token THEN l.acquired_at ELSE clock_timestamp() END,
      token = p_token,
      holder = p_holder,
      expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
    WHERE l.namespace = p_ns AND l.name = p_name
      AND (l.token = p_token OR l.expires_at <= clock_timestamp())
    RETURNING l.fence
  )
  SELECT i.fence::text FROM inserted i
  UNION ALL
  SELECT t.fence::text FROM taken t;
  PERFORM set_config('lock_timeout', previous, true);
END
$palisade$;
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."lease_extend"(p_ns text, p_name text, p_token text, p_ttl_ms float8, p_lock_wait_ms integer)
RETURNS TABLE (held boolean) LANGUAGE plpgsql VOLATILE AS $palisade$
DECLARE
  previous text := current_setting('lock_timeout');
BEGIN
  PERFORM set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::text, true);
  RETURN QUERY
  UPDATE palisade.leases l SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
  WHERE l.namespace = p_ns AND l.name = p_name AND l.token = p_token AND l.expires_at > clock_timestamp()
  RETURNING true;
  PERFORM set_config('lock_timeout', previous, true);
END
$palisade$;
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."lease_release"(p_ns text, p_name text, p_token text, p_payload text, p_lock_wait_ms integer)
RETURNS TABLE (notified text) LANGUAGE plpgsql VOLATILE AS $palisade$
DECLARE
  previous text := current_setting('lock_timeout');
BEGIN
  PERFORM set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::text, true);
  -- An expired row keeps its token: it behaves like a released one, and release reports the lease as lost.
  RETURN QUERY
  WITH released AS (
    UPDATE palisade.leases l SET token = '', holder = NULL, expires_at = '-infinity'
    WHERE l.namespace = p_ns AND l.name = p_name AND l.token = p_token AND l.expires_at > clock_timestamp()
    RETURNING 1
  )
  SELECT pg_notify('palisade_release', p_payload)::text FROM released;
  PERFORM set_config('lock_timeout', previous, true);
END
$palisade$;
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."lease_inspect"(p_ns text, p_name text, p_lock_wait_ms integer)
RETURNS TABLE (holder text, fence text, acquired_ms text, remaining_ms text) LANGUAGE plpgsql VOLATILE AS $palisade$
DECLARE
  previous text := current_setting('lock_timeout');
BEGIN
  PERFORM set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::text, true);
  RETURN QUERY
  SELECT l.holder, l.fence::text,
         floor(extract(epoch FROM l.acquired_at) * 1000)::int8::text,
         greatest(0, ceil(extract(epoch FROM (l.expires_at - clock_timestamp())) * 1000))::int8::text
  FROM palisade.leases l
  WHERE l.namespace = p_ns AND l.name = p_name AND l.expires_at > clock_timestamp();
  PERFORM set_config('lock_timeout', previous, true);
END
$palisade$;
