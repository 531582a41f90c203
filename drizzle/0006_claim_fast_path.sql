-- Custom SQL migration: the common claim first, and no function planned per call.
-- A lock-scoped write whose register already holds its fence (the grant claimed it, or an earlier
-- write did) now shares the register row in one query; this database's source id is looked up only
-- where a grant of this database must be told apart (before, every claim looked it up, through a
-- SQL function that Postgres plans again on each call). register_grant becomes PL/pgSQL for the
-- same reason: its plan is cached per session. What each function decides is unchanged (0005).
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
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."register_grant"(p_kind text, p_ns text, p_name text, p_fence bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  registered bigint;
BEGIN
  INSERT INTO palisade.lock_registers AS r (kind, source, namespace, name, fence)
  VALUES (p_kind, (SELECT s.source_id FROM palisade.fence_sources s), p_ns, p_name, p_fence)
  ON CONFLICT (kind, source, namespace, name) DO UPDATE SET fence = greatest(r.fence, excluded.fence)
  RETURNING r.fence INTO registered;
  RETURN registered;
END $$;
--> statement-breakpoint
-- Every grant of a lock raises its register row: the same few rows are updated over and over, as
-- the lease rows are (0001). Room for HOT updates on the page, and a vacuum after a fixed number of
-- dead versions rather than a fifth of a table that may be tiny.
ALTER TABLE "palisade"."lock_registers" SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0);
