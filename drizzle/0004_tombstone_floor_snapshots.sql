-- Under REPEATABLE READ or SERIALIZABLE the floor check reads the transaction's snapshot, which cannot
-- see a purge that committed after it began: a stale upsert then re-created the purged row. There,
-- touching the floor row with INSERT … ON CONFLICT DO NOTHING makes Postgres raise 40001 whenever a
-- floor row was created or changed after the snapshot (its newest version is invisible to it).
CREATE OR REPLACE FUNCTION "palisade"."check_tombstone_floor"(target_table text, fence bigint, allow_equal boolean)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  current_floor bigint;
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    INSERT INTO palisade.tombstone_floors (table_name, floor) VALUES (target_table, 0) ON CONFLICT DO NOTHING;
  END IF;
  SELECT f.floor INTO current_floor FROM palisade.tombstone_floors f WHERE f.table_name = target_table;
  IF current_floor IS NOT NULL AND (fence < current_floor OR (fence = current_floor AND NOT allow_equal)) THEN
    RAISE EXCEPTION 'palisade: a concurrent purge of tombstones in % raised the floor to this fence or above', target_table
      USING ERRCODE = '40001';
  END IF;
  RETURN true;
END $$;
