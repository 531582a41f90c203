-- Custom SQL migration: one 16-byte key per lock register, so that a lock-scoped write whose
-- register already holds its fence finds that row by one uuid parameter rather than four text
-- parameters (kind, source, namespace, name), and by one fixed-width index probe. The key is a
-- function of the four parts only: the first 16 bytes of the SHA-256 of each part's UTF-8 bytes,
-- each preceded by its length (4 bytes, big-endian), so two different locks never encode alike.
-- src/repo/register-key.ts computes the same key on the client. convert_to is STABLE only because
-- it depends on the database's encoding, which never changes: the key is immutable in fact.
CREATE FUNCTION "palisade"."lock_key"(p_kind text, p_source text, p_ns text, p_name text)
RETURNS uuid LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT encode(substring(sha256(
    int4send(length(convert_to(p_kind, 'UTF8'))) || convert_to(p_kind, 'UTF8') ||
    int4send(length(convert_to(p_source, 'UTF8'))) || convert_to(p_source, 'UTF8') ||
    int4send(length(convert_to(p_ns, 'UTF8'))) || convert_to(p_ns, 'UTF8') ||
    int4send(length(convert_to(p_name, 'UTF8'))) || convert_to(p_name, 'UTF8')
  ) FROM 1 FOR 16), 'hex')::uuid
$$;
--> statement-breakpoint
ALTER TABLE "palisade"."lock_registers" ADD COLUMN "lock_key" uuid GENERATED ALWAYS AS (palisade.lock_key("kind", "source", "namespace", "name")) STORED NOT NULL;
--> statement-breakpoint
CREATE UNIQUE INDEX "lock_registers_lock_key" ON "palisade"."lock_registers" USING btree ("lock_key");
