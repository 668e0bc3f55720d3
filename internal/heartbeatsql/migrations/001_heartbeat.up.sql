-- idem_heartbeat: one sample every few seconds from each running instance
-- (components/heartbeat): who it is, its mode and version, and its
-- middleware's cumulative counters since it started. The last sample of an
-- instance is its "last seen"; the differences between consecutive samples
-- of one run (instance, started_at) are its rates. The writers delete the
-- samples older than their Keep.
CREATE TABLE IF NOT EXISTS {{ident .Schema "idem_heartbeat"}} (
    instance       text        NOT NULL,
    started_at     timestamptz NOT NULL,
    at             timestamptz NOT NULL DEFAULT now(),
    consumer_group text        NOT NULL DEFAULT '',
    mode           text        NOT NULL DEFAULT '',
    version        text        NOT NULL DEFAULT '',
    processed      bigint      NOT NULL DEFAULT 0,
    duplicates     bigint      NOT NULL DEFAULT 0,
    failed         bigint      NOT NULL DEFAULT 0,
    rejected       bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (instance, at)
);

-- The series of the last hour, and the writers' pruning.
CREATE INDEX IF NOT EXISTS idem_heartbeat_at_idx ON {{ident .Schema "idem_heartbeat"}} (at);
