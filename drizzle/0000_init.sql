CREATE SCHEMA "palisade";
--> statement-breakpoint
CREATE SEQUENCE "palisade"."epoch_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1;--> statement-breakpoint
CREATE SEQUENCE "palisade"."fence_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1;--> statement-breakpoint
CREATE TABLE "palisade"."leases" (
	"namespace" text NOT NULL,
	"name" text NOT NULL,
	"token" text NOT NULL,
	"holder" text,
	"fence" bigint NOT NULL,
	"acquired_at" timestamp with time zone NOT NULL,
	"expires_at" timestamp with time zone NOT NULL,
	CONSTRAINT "leases_namespace_name_pk" PRIMARY KEY("namespace","name")
);
--> statement-breakpoint
CREATE INDEX "leases_expires_at_idx" ON "palisade"."leases" USING btree ("expires_at");