-- Custom SQL migration: a grant names the fence source it claimed its register under.
--
-- A lease names its lock's source, and its lock-scoped writes claim that source's register. The grant
-- claimed the register under palisade.fence_source_id() as its own statement read it, but the client
-- named the id it had read once, before its first grant. With the id changed while managers ran (a
-- copy given an id of its own, as the README asks), a manager started before the change named the old
-- id for fences of the same sequence whose grants claimed under the new one, and a manager started
-- after named the new id: two holders of one lock filled two registers, and a stale lock-scoped write
-- landed on a row the newer holder had not written. Now a grant reads the id once, claims under it and
-- returns it, and the client names what its grant returned: from an id change on, every grant of every
-- manager names the new id.
--
-- The id is read once the grant holds its lock (the lease row, the advisory lock), by granting_source_id()
-- below: not in the grant statement's own snapshot, which the server takes when the statement is bound —
-- an advisory grant whose Execute reached the server late (a link that split its messages) drew a fence
-- above another manager's grant made after an id change, yet named the id its snapshot saw, the old one.
CREATE FUNCTION "palisade"."granting_source_id"() RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  src text;
BEGIN
  IF current_setting('transaction_isolation') = 'read committed' THEN
    -- A statement of a volatile function takes a snapshot of its own: every id committed before it.
    SELECT s.source_id INTO src FROM palisade.fence_sources s;
  ELSE
    -- One snapshot for the whole transaction, taken before the grant held its lock: an id changed since
    -- fails this read (40001, a serialization failure: nothing granted, the grant is asked again).
    SELECT s.source_id INTO src FROM palisade.fence_sources s FOR SHARE;
  END IF;
  RETURN src;
END $$;
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."register_grant"(p_kind text, p_source text, p_ns text, p_name text, p_fence bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  registered bigint;
BEGIN
  -- As in 0009: one probe on the common path (the row there and free: it is now this grant's); only
  -- when it finds nothing is it asked whether the row is there below this fence, i.e. locked.
  PERFORM 1 FROM palisade.lock_registers r
    WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name AND r.fence < p_fence
    FOR NO KEY UPDATE SKIP LOCKED;
  IF NOT FOUND AND EXISTS (SELECT 1 FROM palisade.lock_registers r
      WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name AND r.fence < p_fence) THEN
    PERFORM palisade.end_stalled_sharers(p_kind, p_source, p_ns, p_name, p_fence);
  END IF;
  INSERT INTO palisade.lock_registers AS r (kind, source, namespace, name, fence)
  VALUES (p_kind, p_source, p_ns, p_name, p_fence)
  ON CONFLICT (kind, source, namespace, name) DO UPDATE SET fence = greatest(r.fence, excluded.fence)
  RETURNING r.fence INTO registered;
  RETURN registered;
END $$;
--> statement-breakpoint
-- The four-argument form, which clients of earlier versions call: under the id read now.
CREATE OR REPLACE FUNCTION "palisade"."register_grant"(p_kind text, p_ns text, p_name text, p_fence bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  RETURN palisade.register_grant(p_kind, (SELECT s.source_id FROM palisade.fence_sources s), p_ns, p_name, p_fence);
END $$;
--> statement-breakpoint
-- lease_grant as in 0005, returning the id its register claim was made under too (a new result column:
-- the function is created again). A client of an earlier version reads granted_fence only.
DROP FUNCTION "palisade"."lease_grant"(text, text, text, text, float8, integer);
--> statement-breakpoint
CREATE FUNCTION "palisade"."lease_grant"(p_ns text, p_name text, p_token text, p_holder text, p_ttl_ms float8, p_lock_wait_ms integer)
RETURNS TABLE (granted_fence text, granted_source text) LANGUAGE plpgsql VOLATILE AS $palisade$
DECLARE
  previous text := current_setting('lock_timeout');
  got bigint;
  src text;
BEGIN
  PERFORM set_config('lock_timeout', greatest(p_lock_wait_ms, 1)::text, true);
  -- Insert the lock's first row, or take over the row if it is expired (or released) or
  -- already ours (a re-sent grant: same fence). CASE evaluates nextval() only on the branch taken.
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
  SELECT f INTO got FROM (SELECT i.fence AS f FROM inserted i UNION ALL SELECT t.fence FROM taken t) g;
  IF got IS NOT NULL THEN
    -- The grant claims its lock's register (palisade.lock_registers) in the same transaction, under
    -- the id read here, holding the lease row, which it returns: from this commit on, every
    -- lock-scoped write of a lower fence of this lock is refused.
    src := palisade.granting_source_id();
    PERFORM palisade.register_grant('postgres', src, p_ns, p_name, got);
    granted_fence := got::text;
    granted_source := src;
    RETURN NEXT;
  END IF;
  PERFORM set_config('lock_timeout', previous, true);
END
$palisade$;
