-- idem_audit: the operator's actions taken from idemctl serve (replay,
-- discard, edit-and-replay of poison messages), one row per action, on the
-- database's clock. Append-only: the trigger below refuses UPDATE, DELETE and
-- TRUNCATE, so that the console (or anyone without the table owner's rights
-- to drop the trigger) cannot rewrite the trail.
CREATE TABLE IF NOT EXISTS {{ident .Schema "idem_audit"}} (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL CHECK (actor <> ''),
    action  text        NOT NULL CHECK (action <> ''),
    topic   text        NOT NULL,
    filter  jsonb,
    result  text        NOT NULL CHECK (result IN ('ok', 'refused', 'failed')),
    detail  text        NOT NULL DEFAULT ''
);

-- The messages an action touched: where each was on the poison topic, its
-- event id, and for an edit the payload before the edit.
CREATE TABLE IF NOT EXISTS {{ident .Schema "idem_audit_message"}} (
    audit_id         bigint NOT NULL REFERENCES {{ident .Schema "idem_audit"}} (id),
    topic            text   NOT NULL,
    kafka_partition  int    NOT NULL,
    kafka_offset     bigint NOT NULL,
    event_id         text   NOT NULL DEFAULT '',
    original_payload bytea,
    PRIMARY KEY (audit_id, kafka_partition, kafka_offset)
);

-- A page of the explorer looks up what was done to its records.
CREATE INDEX IF NOT EXISTS idem_audit_message_location_idx
    ON {{ident .Schema "idem_audit_message"}} (topic, kafka_partition, kafka_offset);

CREATE OR REPLACE FUNCTION {{ident .Schema "idem_audit_append_only"}}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the audit trail is append-only: % on % refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation';
END $$;

DROP TRIGGER IF EXISTS idem_audit_append_only ON {{ident .Schema "idem_audit"}};
CREATE TRIGGER idem_audit_append_only
    BEFORE UPDATE OR DELETE ON {{ident .Schema "idem_audit"}}
    FOR EACH ROW EXECUTE FUNCTION {{ident .Schema "idem_audit_append_only"}}();
DROP TRIGGER IF EXISTS idem_audit_append_only_truncate ON {{ident .Schema "idem_audit"}};
CREATE TRIGGER idem_audit_append_only_truncate
    BEFORE TRUNCATE ON {{ident .Schema "idem_audit"}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{ident .Schema "idem_audit_append_only"}}();
DROP TRIGGER IF EXISTS idem_audit_message_append_only ON {{ident .Schema "idem_audit_message"}};
CREATE TRIGGER idem_audit_message_append_only
    BEFORE UPDATE OR DELETE ON {{ident .Schema "idem_audit_message"}}
    FOR EACH ROW EXECUTE FUNCTION {{ident .Schema "idem_audit_append_only"}}();
DROP TRIGGER IF EXISTS idem_audit_message_append_only_truncate ON {{ident .Schema "idem_audit_message"}};
CREATE TRIGGER idem_audit_message_append_only_truncate
    BEFORE TRUNCATE ON {{ident .Schema "idem_audit_message"}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{ident .Schema "idem_audit_append_only"}}();
