-- created_at is a TIMESTAMP (without time zone), as watermill-sql creates
-- it. Its default CURRENT_TIMESTAMP is stored in the writing session's
-- TimeZone, so writers in different zones, or a reader (Backlog's oldest
-- age, idemctl) in another zone, mixed clocks: an age off by hours, or
-- negative. From this version on rows get UTC, and readers compare with
-- UTC. Rows written before it keep the zone they were written in.
ALTER TABLE {{ident .Schema .Messages}}
    ALTER COLUMN "created_at" SET DEFAULT (now() AT TIME ZONE 'UTC');
