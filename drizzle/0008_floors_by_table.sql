-- Custom SQL migration: a tombstone floor belongs to the table itself (its regclass), not to the name
-- a repository spelled. Keyed by name, one table named two ways — `s.acc`, and `acc` on a connection
-- whose search_path holds s — had two floors: a purge through one raised a floor the other never
-- read, and a stale upsert through the other re-created a purged row. Keyed by name, the table
-- "s.acc" and the table acc of schema s also shared one. A regclass value is the table's oid; pg_dump
-- writes it as the table's qualified name and a restore resolves it again.
CREATE TABLE "palisade"."tombstone_floors_by_table" (
	"fenced_table" regclass PRIMARY KEY NOT NULL,
	"floor" bigint NOT NULL
);
--> statement-breakpoint
-- An old key was the unquoted `schema.name` or `name` (resolved by this session's search_path), so it
-- may name more than one table: every table it can name keeps its floor (refusing more, never less).
INSERT INTO "palisade"."tombstone_floors_by_table" ("fenced_table", "floor")
SELECT c.fenced_table, max(f.floor)
FROM "palisade"."tombstone_floors" f
CROSS JOIN LATERAL (
  SELECT to_regclass(quote_ident(f.table_name))
  UNION ALL
  SELECT to_regclass(quote_ident(left(f.table_name, d.at - 1)) || '.' || quote_ident(substr(f.table_name, d.at + 1)))
  FROM generate_series(1, length(f.table_name)) AS d(at)
  WHERE substr(f.table_name, d.at, 1) = '.'
) AS c(fenced_table)
WHERE c.fenced_table IS NOT NULL
GROUP BY c.fenced_table;
--> statement-breakpoint
DROP FUNCTION "palisade"."check_tombstone_floor"(text, bigint, boolean);
--> statement-breakpoint
DROP TABLE "palisade"."tombstone_floors";
--> statement-breakpoint
ALTER TABLE "palisade"."tombstone_floors_by_table" RENAME TO "tombstone_floors";
--> statement-breakpoint
ALTER TABLE "palisade"."tombstone_floors" RENAME CONSTRAINT "tombstone_floors_by_table_pkey" TO "tombstone_floors_pkey";
--> statement-breakpoint
-- As in migrations 0003–0004, now by regclass: called by an upsert on a row it newly inserted, with a
-- fresh snapshot (VOLATILE); under REPEATABLE READ or SERIALIZABLE, touching the floor row makes
-- Postgres raise 40001 when a purge created or raised it after the transaction's snapshot.
CREATE FUNCTION "palisade"."check_tombstone_floor"(target regclass, fence bigint, allow_equal boolean)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  current_floor bigint;
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    INSERT INTO palisade.tombstone_floors (fenced_table, floor) VALUES (target, 0) ON CONFLICT DO NOTHING;
  END IF;
  SELECT f.floor INTO current_floor FROM palisade.tombstone_floors f WHERE f.fenced_table = target;
  IF current_floor IS NOT NULL AND (fence < current_floor OR (fence = current_floor AND NOT allow_equal)) THEN
    RAISE EXCEPTION 'palisade: a concurrent purge of tombstones in % raised the floor to this fence or above', target
      USING ERRCODE = '40001';
  END IF;
  RETURN true;
END $$;
