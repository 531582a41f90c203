-- Custom SQL migration: one function raises a tombstone floor, in a command of its own.
--
-- A purge raised the floor with an INSERT … ON CONFLICT DO UPDATE in its own statement. A floor row
-- that a command nested in that statement had written first — the fence trigger's, for a tombstone that
-- a user's BEFORE DELETE trigger removed while the purge ran — is invisible to the purge's command, and
-- Postgres refused the purge (21000) rather than update it. A statement of a VOLATILE function runs as a
-- command of its own, after every command before it: the purge, and the fence trigger, raise through
-- this one.
CREATE FUNCTION "palisade"."raise_floor"(floor_of regclass, fence bigint)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  INSERT INTO palisade.tombstone_floors (fenced_table, floor) VALUES (floor_of, fence)
    ON CONFLICT (fenced_table) DO UPDATE SET floor = greatest(palisade.tombstone_floors.floor, excluded.floor);
  RETURN true;
END $$;
