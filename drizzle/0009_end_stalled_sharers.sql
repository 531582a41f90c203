-- Custom SQL migration: a grant or a raise of a lock register ends the sessions that share the
-- register row at a lower fence while stalled in the middle of a statement.
--
-- A transaction that shares the row (a fenced transaction, a lock-scoped write in a transaction) is
-- bounded by its idle timeout, set to its lease's TTL left. But Postgres counts a session as idle only
-- once it has said it is ready for the next query. postgres.js sends a statement with parameters that
-- is new on its connection to be described first (Parse, Describe, Flush) and binds it when the
-- description is back: a holder stopped in between (SIGSTOP, a VM pause) left its session `active`,
-- waiting on ClientRead, where no timeout fires, and the register row locked for as long as it was
-- stopped — every grant found the lock busy.
--
-- A grant (register_grant) or a raise (claim_lock) is for a fence above the register's. A session
-- that only shares the row shares it at the register's fence: a lease that has expired or was
-- released, since a higher fence was issued. That is checked again while the sessions are ended (a
-- stale claim that read the register before a newer holder raised it must not end that holder).
-- Ending it rolls its transaction back, which is also what its idle timeout would do. A session that
-- wrote to a register row in its transaction (a raise not yet committed) may be the newest holder's:
-- while one holds the row nobody is ended. Nor is a session of a role this one may not signal
-- (pg_terminate_backend refuses; the raise then waits as before).
--
-- Which sessions share the row is told by a tag: every statement with which palisade keeps a claim
-- past its own end (a fenced transaction's claim, a claim that bounds its transaction's idle time)
-- also takes a shared transaction-level advisory lock named after the register (register_tag below;
-- the client computes the same two integers, src/repo/register-key.ts), which Postgres shows in
-- pg_locks under the session's pid until its transaction ends, savepoints and all. The two-integer
-- form keeps these apart from the advisory lock backend's keys (one bigint).
CREATE FUNCTION "palisade"."register_tag"(p_key uuid, OUT k1 integer, OUT k2 integer)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT ('x' || substr(h, 1, 8))::bit(32)::integer & 2147483647, ('x' || substr(h, 9, 8))::bit(32)::integer & 2147483647
  FROM (SELECT replace(p_key::text, '-', '') AS h) s
$$;
--> statement-breakpoint
CREATE FUNCTION "palisade"."end_stalled_sharers"(p_kind text, p_source text, p_ns text, p_name text, p_fence bigint)
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
  -- Share the row for as long as we look: no raise commits meanwhile, so every tagged session shares
  -- at `shared_at` — the newest fence committed, read by this locking read — or holds no share at all.
  -- FOR SHARE skips a row a raise not yet committed holds (it may be the newest holder's): then
  -- nobody is ended. The share goes with the subtransaction.
  BEGIN
    SELECT r.fence INTO shared_at FROM palisade.lock_registers r WHERE r.lock_key = register_key FOR SHARE SKIP LOCKED;
    IF FOUND AND shared_at < p_fence THEN
      FOR target IN
        SELECT DISTINCT a.pid FROM palisade.register_tag(register_key) t, pg_locks l
          JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
          AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND l.classid = t.k1::oid AND l.objid = t.k2::oid AND a.pid <> pg_backend_pid()
          AND a.state = 'active' AND a.wait_event_type = 'Client' AND a.wait_event = 'ClientRead'
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
-- register_grant as in 0006, but a grant that raises a register row it finds locked first ends the
-- stalled sharers (above). A re-sent grant (the register already at its fence) ends nobody: those
-- sharers are its own holder's.
CREATE OR REPLACE FUNCTION "palisade"."register_grant"(p_kind text, p_ns text, p_name text, p_fence bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  src text := (SELECT s.source_id FROM palisade.fence_sources s);
  registered bigint;
BEGIN
  -- One probe on the common path (the row there and free: it is now this grant's); only when it finds
  -- nothing is it asked whether the row is there below this fence, i.e. locked.
  PERFORM 1 FROM palisade.lock_registers r
    WHERE r.kind = p_kind AND r.source = src AND r.namespace = p_ns AND r.name = p_name AND r.fence < p_fence
    FOR NO KEY UPDATE SKIP LOCKED;
  IF NOT FOUND AND EXISTS (SELECT 1 FROM palisade.lock_registers r
      WHERE r.kind = p_kind AND r.source = src AND r.namespace = p_ns AND r.name = p_name AND r.fence < p_fence) THEN
    PERFORM palisade.end_stalled_sharers(p_kind, src, p_ns, p_name, p_fence);
  END IF;
  INSERT INTO palisade.lock_registers AS r (kind, source, namespace, name, fence)
  VALUES (p_kind, src, p_ns, p_name, p_fence)
  ON CONFLICT (kind, source, namespace, name) DO UPDATE SET fence = greatest(r.fence, excluded.fence)
  RETURNING r.fence INTO registered;
  RETURN registered;
END $$;
--> statement-breakpoint
-- claim_lock as in 0006, but a raise that finds the register row locked first ends the stalled
-- sharers (above).
CREATE OR REPLACE FUNCTION "palisade"."claim_lock"(p_kind text, p_source text, p_ns text, p_name text, p_fence bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE COST 10000 AS $$
DECLARE
  current_fence bigint;
  granted_here boolean;
BEGIN
  -- Shared: holders at one fence never wait for each other, and a raise waits for all of them. A raise
  -- in progress is waited for, and its newest row version no longer matches: the loop decides.
  SELECT r.fence INTO current_fence FROM palisade.lock_registers r
    WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name AND r.fence = p_fence
    FOR SHARE;
  IF FOUND THEN RETURN current_fence; END IF;
  FOR attempt IN 1..50 LOOP
    SELECT r.fence INTO current_fence FROM palisade.lock_registers r
      WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name;
    IF FOUND AND current_fence > p_fence THEN RETURN current_fence; END IF;
    IF FOUND AND current_fence = p_fence THEN
      SELECT r.fence INTO current_fence FROM palisade.lock_registers r
        WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name FOR SHARE;
      IF FOUND AND current_fence >= p_fence THEN RETURN current_fence; END IF;
    ELSE
      granted_here := coalesce(granted_here,
        p_kind IN ('postgres', 'advisory') AND p_source = (SELECT s.source_id FROM palisade.fence_sources s));
      IF granted_here THEN RETURN coalesce(current_fence, 0); END IF;
      IF FOUND THEN
        PERFORM 1 FROM palisade.lock_registers r
          WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name
          FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN PERFORM palisade.end_stalled_sharers(p_kind, p_source, p_ns, p_name, p_fence); END IF;
        UPDATE palisade.lock_registers r SET fence = p_fence
          WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name AND r.fence < p_fence;
        IF FOUND THEN RETURN p_fence; END IF;
      ELSE
        INSERT INTO palisade.lock_registers (kind, source, namespace, name, fence)
          VALUES (p_kind, p_source, p_ns, p_name, p_fence) ON CONFLICT DO NOTHING;
        IF FOUND THEN RETURN p_fence; END IF;
      END IF;
    END IF;
    -- The row changed between the read and the write (a concurrent insert or raise): look again.
  END LOOP;
  RAISE EXCEPTION 'palisade: the lock register kept changing under this claim' USING ERRCODE = '40001';
END $$;
