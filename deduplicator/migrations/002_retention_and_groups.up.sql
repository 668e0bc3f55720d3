-- The table's retention, recorded once so that every component agrees on it:
-- the middleware's stale guard and the Cleaner both read it, and a configured
-- retention that differs is refused (ErrRetentionMismatch). Change it with
-- deduplicator.SetRetention, which keeps the previous value: a shortening
-- takes effect for the Cleaner only once every running consumer has re-read
-- it (they re-read it every RetentionRefreshInterval). cleaned_before is the
-- highest cutoff the Cleaner has applied: claims of events created before it
-- may be gone (for groups that are not young), whatever the retention is now,
-- so lengthening the retention never revives a deleted claim's event. One row.
CREATE TABLE IF NOT EXISTS {{ident .Schema (print .Table "_setting")}} (
    singleton          boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    retention          interval    NOT NULL CHECK (retention > interval '0'),
    previous_retention interval,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    cleaned_before     timestamptz
);
INSERT INTO {{ident .Schema (print .Table "_setting")}} (retention)
VALUES (interval '1 microsecond' * {{.RetentionMicros}})
ON CONFLICT DO NOTHING;

-- The consumer groups that claim in the table. first_seen_at decides the
-- stale guard: a group first seen less than a retention ago cannot have lost
-- a claim to the Cleaner, so it processes old backlog instead of refusing it;
-- the Cleaner, in turn, keeps such a group's claims until it is older than
-- the retention. idempotency_namespace keeps Idempotency-Keys stable when a
-- group is renamed (deduplicator.RenameGroup copies it).
CREATE TABLE IF NOT EXISTS {{ident .Schema (print .Table "_group")}} (
    consumer_group        text        PRIMARY KEY,
    first_seen_at         timestamptz NOT NULL DEFAULT now(),
    idempotency_namespace text        NOT NULL,
    started_at            timestamptz NOT NULL DEFAULT now()
);

-- Groups that already hold claims: when they started is unknown, so they are
-- taken as old enough to have lost claims (first_seen_at -infinity): their
-- stale guard stays on, as before this migration.
INSERT INTO {{ident .Schema (print .Table "_group")}} (consumer_group, first_seen_at, idempotency_namespace)
SELECT DISTINCT consumer_group, '-infinity'::timestamptz, consumer_group FROM {{ident .Schema .Table}}
ON CONFLICT DO NOTHING;
