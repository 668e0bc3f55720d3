-- A parked event keeps its message (retrytopic.KeyOrder): the events behind
-- a key's first parked event wait here, not on a retry topic, and each is
-- written to the retry path (through the outbox) only when the event before
-- it is done. topic and not_before are NULL while an event waits here: only
-- a key's first event has a copy on the retry path.
ALTER TABLE {{ident .Schema .Table}}
    ADD COLUMN IF NOT EXISTS message_uuid text,
    ADD COLUMN IF NOT EXISTS payload      bytea,
    ADD COLUMN IF NOT EXISTS metadata     jsonb,
    ALTER COLUMN topic DROP NOT NULL,
    ALTER COLUMN not_before DROP NOT NULL;
