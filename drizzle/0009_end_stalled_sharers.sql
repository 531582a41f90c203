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
-- released, since a higher fence was issued. Ending it rolls its transaction back, which is also what
-- its idle timeout would do. A session that wrote to a register row in its transaction (a raise not
-- yet committed) may be the newest holder's: it is left alone. So is a session of a role this one
-- may not signal (pg_terminate_backend refuses; the raise then waits as before).
--
-- Which transactions lock the row is read from its xmax: one locker's transaction id, or a multixact
-- whose members are; a session counts only if its transaction is one of those, it holds a lock on the
-- register table, has written none of it, and is waiting on its client in the middle of a statement.
CREATE FUNCTION "palisade"."end_stalled_sharers"(p_kind text, p_source text, p_ns text, p_name text)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  locker xid;
  lockers xid[];
  target integer;
  ended integer := 0;
BEGIN
  SELECT r.xmax INTO locker FROM palisade.lock_registers r
    WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name;
  IF locker IS NULL OR locker::text = '0' THEN RETURN 0; END IF;
  lockers := ARRAY[locker];
  BEGIN
    lockers := lockers || ARRAY(SELECT m.xid FROM pg_get_multixact_members(locker) m);
  EXCEPTION WHEN OTHERS THEN
    NULL; -- not a multixact id: one locker
  END;
  FOR target IN
    SELECT a.pid FROM pg_stat_activity a
    WHERE a.backend_xid = ANY (lockers) AND a.pid <> pg_backend_pid()
      AND a.state = 'active' AND a.wait_event_type = 'Client' AND a.wait_event = 'ClientRead'
      AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'relation'
        AND l.relation = 'palisade.lock_registers'::regclass AND l.mode = 'RowShareLock')
      AND NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'relation'
        AND l.relation = 'palisade.lock_registers'::regclass AND l.mode <> 'RowShareLock' AND l.mode <> 'AccessShareLock')
  LOOP
    BEGIN
      IF pg_terminate_backend(target) THEN ended := ended + 1; END IF;
    EXCEPTION WHEN insufficient_privilege THEN
      NULL;
    END;
  END LOOP;
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
  PERFORM 1 FROM palisade.lock_registers r
    WHERE r.kind = p_kind AND r.source = src AND r.namespace = p_ns AND r.name = p_name AND r.fence < p_fence;
  IF FOUND THEN
    PERFORM 1 FROM palisade.lock_registers r
      WHERE r.kind = p_kind AND r.source = src AND r.namespace = p_ns AND r.name = p_name
      FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN PERFORM palisade.end_stalled_sharers(p_kind, src, p_ns, p_name); END IF;
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
        IF NOT FOUND THEN PERFORM palisade.end_stalled_sharers(p_kind, p_source, p_ns, p_name); END IF;
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
