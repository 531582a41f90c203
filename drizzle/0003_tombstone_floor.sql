CREATE TABLE "palisade"."tombstone_floors" (
	"table_name" text PRIMARY KEY NOT NULL,
	"floor" bigint NOT NULL
);
--> statement-breakpoint
-- Called by an upsert on a row it newly inserted. VOLATILE: its query takes a fresh snapshot, so
-- it sees a purge that committed after the upsert's own snapshot was taken (the purge removed the
-- tombstone the upsert would otherwise have hit). 40001: the upsert is retryable, and a retry
-- sees the raised floor and reports the write as stale.
CREATE FUNCTION "palisade"."check_tombstone_floor"(target_table text, fence bigint, allow_equal boolean)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  current_floor bigint;
BEGIN
  SELECT f.floor INTO current_floor FROM palisade.tombstone_floors f WHERE f.table_name = target_table;
  IF current_floor IS NOT NULL AND (fence < current_floor OR (fence = current_floor AND NOT allow_equal)) THEN
    RAISE EXCEPTION 'palisade: a concurrent purge of tombstones in % raised the floor to this fence or above', target_table
      USING ERRCODE = '40001';
  END IF;
  RETURN true;
END $$;
