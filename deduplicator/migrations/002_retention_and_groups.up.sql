-- The table's retention, recorded once so that every component agrees on it:
-- the middleware's stale guard and the Cleaner both read it at start-up, and a
-- configured retention that differs is refused (ErrRetentionMismatch). Change
-- it with deduplicator.SetRetention. One row.
CREATE TABLE IF NOT EXISTS {{ident .Schema (print .Table "_setting")}} (
    singleton    boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    retention    interval    NOT NULL CHECK (retention > interval '0'),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {{ident .Schema (print .Table "_setting")}} (retention)
VALUES (interval '1 microsecond' * {{.RetentionMicros}})
ON CONFLICT DO NOTHING;

-- The consumer groups that claim in the table. first_seen_at decides the
-- stale guard: a group first seen less than a retention ago cannot have lost
-- a claim to the Cleaner, so it processes old backlog instead of refusing it;
-- the Cleaner, in turn, keeps such a group's claims until it is older than
-- the retention. idempotency_namespace keeps Idempotency-Keys stable when a
-- group is renamed (deduplicator.RenameGroup copies it). retention is the
-- value the group's consumers started with: the Cleaner refuses to run with a
-- shorter one (ErrRetentionMismatch) until they restart.
CREATE TABLE IF NOT EXISTS {{ident .Schema (print .Table "_group")}} (
    consumer_group        text        PRIMARY KEY,
    first_seen_at         timestamptz NOT NULL DEFAULT now(),
    idempotency_namespace text        NOT NULL,
    retention             interval    NOT NULL,
    started_at            timestamptz NOT NULL DEFAULT now()
);

-- Groups that already hold claims: when they started is unknown, so they are
-- taken as old enough to have lost claims (first_seen_at -infinity): their
-- stale guard stays on, as before this migration.
INSERT INTO {{ident .Schema (print .Table "_group")}} (consumer_group, first_seen_at, idempotency_namespace, retention)
SELECT g.consumer_group, '-infinity', g.consumer_group, s.retention
FROM (SELECT DISTINCT consumer_group FROM {{ident .Schema .Table}}) g
CROSS JOIN {{ident .Schema (print .Table "_setting")}} s
ON CONFLICT DO NOTHING;
