-- Custom SQL migration: lock-scoped fencing (README, "Two scopes of fencing").
-- palisade.fence_sources holds one random id of this database, generated once here: it names the
-- database's fence sequence as a source, so registers never compare its fences with another
-- database's (a lease manager on another database has another id).
CREATE TABLE "palisade"."fence_sources" (
	"singleton" boolean PRIMARY KEY DEFAULT true NOT NULL CHECK ("singleton"),
	"source_id" text NOT NULL
);
--> statement-breakpoint
INSERT INTO "palisade"."fence_sources" ("source_id") VALUES ('pg:' || md5(random()::text || clock_timestamp()::text || pg_backend_pid()::text));
--> statement-breakpoint
CREATE FUNCTION "palisade"."fence_source_id"() RETURNS text LANGUAGE sql STABLE AS $$
  SELECT source_id FROM palisade.fence_sources
$$;
--> statement-breakpoint
-- One row per lock that was ever claimed: the highest fence that claimed it. Rows are never deleted
-- by palisade (a pause has no upper bound, so no age makes a row safe to drop); an operator resets
-- one with `palisade locks reset-register`.
CREATE TABLE "palisade"."lock_registers" (
	"kind" text NOT NULL,
	"source" text NOT NULL,
	"namespace" text NOT NULL,
	"name" text NOT NULL,
	"fence" bigint NOT NULL,
	CONSTRAINT "lock_registers_pkey" PRIMARY KEY("kind","source","namespace","name")
);
--> statement-breakpoint
-- Claims a lock's register for a fence and returns the register's fence afterwards: equal to
-- p_fence when the claim holds (the row is then locked until the transaction ends: shared when the
-- register already was at p_fence, exclusive when this call raised it), higher when a higher fence
-- claimed it first (refused; no lock taken). For locks whose grants claim the register themselves
-- (Postgres leases and advisory locks of THIS database) a fence must BE the registered one: the
-- result is then lower than p_fence (0 when the lock was never granted here) for a fence that was
-- never issued, and nothing is claimed.
CREATE FUNCTION "palisade"."claim_lock"(p_kind text, p_source text, p_ns text, p_name text, p_fence bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE COST 10000 AS $$
DECLARE
  current_fence bigint;
  granted_here boolean := p_kind IN ('postgres', 'advisory') AND p_source = palisade.fence_source_id();
BEGIN
  FOR attempt IN 1..50 LOOP
    SELECT r.fence INTO current_fence FROM palisade.lock_registers r
      WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name;
    IF FOUND THEN
      IF current_fence > p_fence THEN RETURN current_fence; END IF;
      IF current_fence = p_fence THEN
        -- Shared: holders at one fence never wait for each other, and a raise waits for all of them.
        SELECT r.fence INTO current_fence FROM palisade.lock_registers r
          WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name FOR SHARE;
        IF FOUND AND current_fence >= p_fence THEN RETURN current_fence; END IF;
      ELSIF granted_here THEN
        RETURN current_fence;
      ELSE
        UPDATE palisade.lock_registers r SET fence = p_fence
          WHERE r.kind = p_kind AND r.source = p_source AND r.namespace = p_ns AND r.name = p_name AND r.fence < p_fence;
        IF FOUND THEN RETURN p_fence; END IF;
      END IF;
    ELSE
      IF granted_here THEN RETURN 0; END IF;
      INSERT INTO palisade.lock_registers (kind, source, namespace, name, fence)
        VALUES (p_kind, p_source, p_ns, p_name, p_fence) ON CONFLICT DO NOTHING;
      IF FOUND THEN RETURN p_fence; END IF;
    END IF;
    -- The row changed between the read and the write (a concurrent insert or raise): look again.
  END LOOP;
  RAISE EXCEPTION 'palisade: the lock register kept changing under this claim' USING ERRCODE = '40001';
END $$;
--> statement-breakpoint
-- Several claims in one statement, in one sorted order (kind, source, namespace, name) so that two
-- transactions claiming overlapping sets never wait for each other in a cycle. p_locks: a JSON array
-- of {kind, source, namespace, name, fence} (fence as a string). Returns one row per lock, in that order.
CREATE FUNCTION "palisade"."claim_locks"(p_locks jsonb)
RETURNS TABLE (kind text, source text, namespace text, name text, fence text, registered text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  l record;
BEGIN
  FOR l IN
    SELECT e->>'kind' AS k, e->>'source' AS s, e->>'namespace' AS n, e->>'name' AS m, (e->>'fence')::bigint AS f
    FROM jsonb_array_elements(p_locks) e
    ORDER BY e->>'kind' COLLATE "C", e->>'source' COLLATE "C", e->>'namespace' COLLATE "C", e->>'name' COLLATE "C",
      (e->>'fence')::bigint
  LOOP
    kind := l.k; source := l.s; namespace := l.n; name := l.m; fence := l.f::text;
    registered := palisade.claim_lock(l.k, l.s, l.n, l.m, l.f)::text;
    RETURN NEXT;
  END LOOP;
END $$;
--> statement-breakpoint
-- What a grant does to its lock's register, in the grant's own statement: raise it to the new fence
-- (a re-sent grant finds it there already). A register row locked by a fenced transaction waits
-- within the grant's lock_timeout, and a grant that times out is not granted (the lock is busy).
CREATE FUNCTION "palisade"."register_grant"(p_kind text, p_ns text, p_name text, p_fence bigint)
RETURNS bigint LANGUAGE sql VOLATILE AS $$
  INSERT INTO palisade.lock_registers AS r (kind, source, namespace, name, fence)
  VALUES (p_kind, palisade.fence_source_id(), p_ns, p_name, p_fence)
  ON CONFLICT (kind, source, namespace, name) DO UPDATE SET fence = greatest(r.fence, excluded.fence)
  RETURNING r.fence
$$;
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."lease_grant"(p_ns text, p_name text, p_token text, p_holder text, p_ttl_ms float8, p_lock_wait_ms integer)
RETURNS TABLE (granted_fence text) LANGUAGE plpgsql VOLATILE AS $palisade$
DECLARE
  previous text := current_setting('lock_timeout');
  got bigint;
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
    -- The grant claims its lock's register (palisade.lock_registers) in the same transaction: from
    -- this commit on, every lock-scoped write of a lower fence of this lock is refused.
    PERFORM palisade.register_grant('postgres', p_ns, p_name, got);
    granted_fence := got::text;
    RETURN NEXT;
  END IF;
  PERFORM set_config('lock_timeout', previous, true);
END
$palisade$;
