-- processed_event: one row per (event, consumer group) that was applied.
-- The primary key is the dedup: the database, not application code, decides
-- which of two concurrent claims of the same event is first.
CREATE TABLE IF NOT EXISTS {{ident .Schema .Table}} (
    event_id       uuid        NOT NULL,
    consumer_group text        NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, consumer_group)
);

-- Retention by age for ids that are not UUIDv7 (a v7 id carries its own time,
-- so the cleaner can use the primary key instead).
CREATE INDEX IF NOT EXISTS {{ident (print .Table "_processed_at_idx")}}
    ON {{ident .Schema .Table}} (processed_at);
