-- Each consumer group's position per Kafka partition, kept in the same
-- database as the claims it covers (DESIGN §12): next_offset is the offset
-- below which every record of the partition is settled (its claim and
-- business rows committed, or it was refused), and done lists, for the
-- parallel subscriber, the runs of settled offsets above it (the encoding
-- of its Kafka commit metadata). It is written only after the commits it
-- covers: in their own transaction (the dedup middleware, for watermill-
-- kafka's subscriber), or by the subscriber once they are acked (the
-- parallel subscriber). PostgreSQL's WAL is one ordered history, so any
-- state of the database (a promoted asynchronous standby, a point-in-time
-- restore) that holds a row's value also holds every commit it covers,
-- and a subscriber that starts from it skips nothing. One row per
-- (group, topic, partition), updated in place (HOT: no indexed column
-- changes).
CREATE TABLE IF NOT EXISTS {{ident .Schema (print .Table "_progress")}} (
    consumer_group  text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    next_offset     bigint      NOT NULL CHECK (next_offset >= 0),
    done            text        NOT NULL DEFAULT '',
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, kafka_partition)
);
