DROP INDEX "palisade"."leases_expires_at_idx";--> statement-breakpoint
-- Grants and releases update one small set of rows over and over: leave room for HOT updates
-- on the same page, and vacuum after a fixed number of dead versions, not 20% of a tiny table.
ALTER TABLE "palisade"."leases" SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0);
