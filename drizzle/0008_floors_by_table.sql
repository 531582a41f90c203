-- Custom SQL migration: a tombstone floor belongs to the table itself (its regclass), not to the name
-- a repository spelled. Keyed by name, one table named two ways — `s.acc`, and `acc` on a connection
-- whose search_path holds s — had two floors: a purge through one raised a floor the other never
-- read, and a stale upsert through the other re-created a purged row. Keyed by name, the table
-- "s.acc" and the table acc of schema s also shared one. A regclass value is the table's oid; pg_dump
-- writes it as the table's qualified name and a restore resolves it again.
--
-- An old release's purge that is running now must not raise the old table after its floors were
-- copied: the copy waits for it (and later ones wait for this migration, then fail on the dropped table).
LOCK TABLE "palisade"."tombstone_floors" IN ACCESS EXCLUSIVE MODE;
--> statement-breakpoint
-- The table that holds a floor for `t`: the root of its partition tree (a row moves between
-- partitions, and a purge or an upsert may name the parent or a partition), else `t` itself.
CREATE FUNCTION "palisade"."floor_table"(t regclass)
RETURNS regclass LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT coalesce(pg_partition_root(t), t)
$$;
--> statement-breakpoint
CREATE TABLE "palisade"."tombstone_floors_by_table" (
	"fenced_table" regclass PRIMARY KEY NOT NULL,
	"floor" bigint NOT NULL
);
--> statement-breakpoint
-- An old key was the unquoted `schema.name` or `name`, the latter resolved by each connection's own
-- search_path (a tenant schema per connection, say): every table it can name, in any schema, keeps
-- its floor — refusing more, never less — and so does every table that inherits from one (a purge
-- through an inheritance parent removed its children's rows; their floors are now their own).
INSERT INTO "palisade"."tombstone_floors_by_table" ("fenced_table", "floor")
WITH RECURSIVE named AS (
  SELECT c.oid, f.floor
  FROM "palisade"."tombstone_floors" f
  JOIN pg_catalog.pg_class c ON c.relkind IN ('r', 'p')
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  WHERE c.relname = f.table_name OR n.nspname || '.' || c.relname = f.table_name
  UNION
  SELECT i.inhrelid, named.floor FROM named JOIN pg_catalog.pg_inherits i ON i.inhparent = named.oid
)
SELECT palisade.floor_table(oid::regclass), max(floor) FROM named GROUP BY 1;
--> statement-breakpoint
DROP FUNCTION "palisade"."check_tombstone_floor"(text, bigint, boolean);
--> statement-breakpoint
DROP TABLE "palisade"."tombstone_floors";
--> statement-breakpoint
ALTER TABLE "palisade"."tombstone_floors_by_table" RENAME TO "tombstone_floors";
--> statement-breakpoint
ALTER TABLE "palisade"."tombstone_floors" RENAME CONSTRAINT "tombstone_floors_by_table_pkey" TO "tombstone_floors_pkey";
--> statement-breakpoint
-- As in migrations 0003–0004, now by table: called by an upsert on a row it newly inserted, with a
-- fresh snapshot (VOLATILE); under REPEATABLE READ or SERIALIZABLE, touching the floor row makes
-- Postgres raise 40001 when a purge created or raised it after the transaction's snapshot.
CREATE FUNCTION "palisade"."check_tombstone_floor"(target regclass, fence bigint, allow_equal boolean)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  current_floor bigint;
  key regclass := palisade.floor_table(target);
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    INSERT INTO palisade.tombstone_floors (fenced_table, floor) VALUES (key, 0) ON CONFLICT DO NOTHING;
  END IF;
  SELECT f.floor INTO current_floor FROM palisade.tombstone_floors f WHERE f.fenced_table = key;
  IF current_floor IS NOT NULL AND (fence < current_floor OR (fence = current_floor AND NOT allow_equal)) THEN
    RAISE EXCEPTION 'palisade: a concurrent purge of tombstones in % raised the floor to this fence or above', target
      USING ERRCODE = '40001';
  END IF;
  RETURN true;
END $$;
