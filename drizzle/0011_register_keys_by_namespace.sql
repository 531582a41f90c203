-- Custom SQL migration: a register key that keeps one namespace's locks together.
--
-- 0007's key was the first 16 bytes of one SHA-256 of the lock's four parts: random across the whole
-- register table. A lock-scoped write finds its register by that key, so a lock manager's live locks,
-- however few, sat on as many leaves of the key's index as they were locks; in a table of 2,000,000
-- registers, 1,000 live locks cost a write at 16 clients a third more than one lock did (pgbench), the
-- random reads, not the row lock. The key is now two halves: the first 8 bytes of the SHA-256 of kind,
-- source and namespace, then the first 8 bytes of the SHA-256 of all four parts (each part preceded by
-- its UTF-8 length, 4 bytes big-endian, as before). One namespace's registers share the first half and
-- sit side by side in the index, whatever else the table holds; two locks of one namespace share a key
-- only if 64 bits of their hashes do. src/repo/register-key.ts computes the same key.
--
-- The column is computed again for every row (a table rewrite under ACCESS EXCLUSIVE: lock-scoped
-- writes and grants that claim wait for it). A sharer's tag takes its first word from the second half
-- now, which tells the locks of one namespace apart as the whole key's first word did.
--
-- The lock is waited for at most 2 s: a session that shares a register and stalled mid-statement (a
-- paused holder) holds it off, and every grant and lock-scoped write would queue behind the migration's
-- request for as long as that holder stays stopped (a grant ends such sessions, migration 0009; a
-- migration does not). The migration then fails (55P03), changes nothing, and is run again.
SELECT set_config('palisade.lock_timeout_before_0011', current_setting('lock_timeout'), true),
  set_config('lock_timeout', '2s', true);
--> statement-breakpoint
ALTER TABLE "palisade"."lock_registers" DROP COLUMN "lock_key";
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."lock_key"(p_kind text, p_source text, p_ns text, p_name text)
RETURNS uuid LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT encode(substring(sha256(ns) FROM 1 FOR 8) || substring(sha256(ns || n) FROM 1 FOR 8), 'hex')::uuid
  FROM (SELECT
      int4send(length(convert_to(p_kind, 'UTF8'))) || convert_to(p_kind, 'UTF8') ||
      int4send(length(convert_to(p_source, 'UTF8'))) || convert_to(p_source, 'UTF8') ||
      int4send(length(convert_to(p_ns, 'UTF8'))) || convert_to(p_ns, 'UTF8') AS ns,
      int4send(length(convert_to(p_name, 'UTF8'))) || convert_to(p_name, 'UTF8') AS n) parts
$$;
--> statement-breakpoint
ALTER TABLE "palisade"."lock_registers" ADD COLUMN "lock_key" uuid GENERATED ALWAYS AS (palisade.lock_key("kind", "source", "namespace", "name")) STORED NOT NULL;
--> statement-breakpoint
CREATE UNIQUE INDEX "lock_registers_lock_key" ON "palisade"."lock_registers" USING btree ("lock_key");
--> statement-breakpoint
CREATE OR REPLACE FUNCTION "palisade"."register_tag"(p_key uuid, p_fence bigint, OUT k1 integer, OUT k2 integer)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT ('x' || substr(h, 17, 8))::bit(32)::integer & 2147483647,
    ('x' || substr(encode(sha256(convert_to(h || ':' || p_fence::text, 'UTF8')), 'hex'), 1, 8))::bit(32)::integer & 2147483647
  FROM (SELECT replace(p_key::text, '-', '') AS h) s
$$;
--> statement-breakpoint
SELECT set_config('lock_timeout', current_setting('palisade.lock_timeout_before_0011'), true);
