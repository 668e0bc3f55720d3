-- retry_parked_key: the events of a key that are on the retry path
-- (retrytopic.KeyOrder), in the order they were parked (seq). While a key
-- has a row, its later events follow the first one instead of overtaking it.
-- topic and not_before tell where the event's latest copy waits, so that a
-- follower can be sent right behind it.
CREATE TABLE IF NOT EXISTS {{ident .Schema .Table}} (
    consumer_group text        NOT NULL,
    partition_key  text        NOT NULL,
    event_id       uuid        NOT NULL,
    seq            bigint      GENERATED ALWAYS AS IDENTITY,
    topic          text        NOT NULL,
    not_before     timestamptz NOT NULL,
    parked_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, partition_key, event_id)
);

-- The first parked event of a key: ORDER BY seq LIMIT 1.
CREATE INDEX IF NOT EXISTS {{ident (print .Table "_order_idx")}}
    ON {{ident .Schema .Table}} (consumer_group, partition_key, seq);
