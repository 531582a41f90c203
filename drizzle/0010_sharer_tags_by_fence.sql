-- Custom SQL migration: a sharer's tag names the fence it claims for, and a raise looks at the
-- sessions afresh (end_stalled_sharers, migration 0009).
--
-- 0009 tagged a transaction by its register alone, and a raise ended every tagged session stalled in
-- the middle of a statement, taking each for a sharer at the register's fence. But a lock-scoped write
-- in a transaction tags it before it claims (the statement that bounds its idle time comes first), so
-- the newest holder's own session, tagged and mid-statement on its way to raise the register
-- (postgres.js describes a statement new on its connection before it binds it), was ended by the raise
-- of another call of the same lease that found a stale holder's share; an attack saw it in 13 of 150
-- trials. The tag now names the fence too: a raise ends only the sessions tagged at the register's
-- committed fence, holders of a lease older than the raising one.
--
-- A raise inside a transaction that had read pg_stat_activity before saw every session as it was at
-- that first read (Postgres keeps one snapshot of it per transaction): a fenced transaction of two
-- locks missed a sharer of the second that stalled meanwhile, and waited for as long as it was stopped.
-- And a sharer stopped while the server sends it a large result waits on ClientWrite: ended too.
CREATE FUNCTION "palisade"."register_tag"(p_key uuid, p_fence bigint, OUT k1 integer, OUT k2 integer)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT ('x' || substr(h, 1, 8))::bit(32)::integer & 2147483647,
    ('x' || substr(encode(sha256(convert_to(h || ':' || p_fence::text, 'UTF8')), 'hex'), 1, 8))::bit(32)::integer & 2147483647
  FROM (SELECT replace(p_key::text, '-', '') AS h) s
$$;
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."end_stalled_sharers"(p_kind text, p_source text, p_ns text, p_name text, p_fence bigint)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  register_key uuid;
  shared_at bigint;
  target integer;
  ended integer := 0;
BEGIN
  SELECT r.lock_key INTO register_key FROM palisade.lock_registers r
    WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name;
  IF NOT FOUND THEN RETURN 0; END IF;
  -- Share the row for as long as we look: no raise commits meanwhile, so every session tagged at
  -- `shared_at` — the newest fence committed, read by this locking read — holds a lease older than
  -- p_fence. FOR SHARE skips a row a raise not yet committed holds (it may be the newest holder's):
  -- then nobody is ended. The share goes with the subtransaction.
  BEGIN
    SELECT r.fence INTO shared_at FROM palisade.lock_registers r WHERE r.lock_key = register_key FOR SHARE SKIP LOCKED;
    IF FOUND AND shared_at < p_fence THEN
      PERFORM pg_stat_clear_snapshot();
      FOR target IN
        SELECT DISTINCT a.pid FROM palisade.register_tag(register_key, shared_at) t, pg_locks l
          JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
          AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND l.classid = t.k1::oid AND l.objid = t.k2::oid AND a.pid <> pg_backend_pid()
          AND a.state = 'active' AND a.wait_event_type = 'Client' AND a.wait_event IN ('ClientRead', 'ClientWrite')
      LOOP
        BEGIN
          IF pg_terminate_backend(target) THEN ended := ended + 1; END IF;
        EXCEPTION WHEN insufficient_privilege THEN
          NULL;
        END;
      END LOOP;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'P0001';
  EXCEPTION WHEN raise_exception THEN
    NULL;
  END;
  RETURN ended;
END $$;
--> statement-breakpoint
DROP FUNCTION "palisade"."register_tag"(uuid);
