-- Rows the forwarder cannot send (poison rows) are moved here, with their
-- cause, instead of failing the topic's relay forever; so are the later rows
-- of their partition key, which wait behind them to keep the key's order.
-- The rest of the topic goes on. idemctl outbox dead list/retry/drop (and
-- Outbox.DeadRows, RetryDead, DropDead) read and release them.
--
--   id            this table's order: a key's rows are retried in it;
--   "offset", transaction_id, uuid, created_at, payload, metadata
--                 the row as it stood in the messages table;
--   partition_key the row's partition_key metadata ('' when none);
--   cause         why it was not sent ("held behind dead row <id>" for a
--                 row waiting behind its key's poison row);
--   held_behind   the id of the poison row it waits behind, or NULL for a
--                 poison row;
--   size          the size of the Kafka record it makes (0: not built).
CREATE TABLE IF NOT EXISTS {{ident .Schema .Dead}} (
    id BIGSERIAL PRIMARY KEY,
    "offset" BIGINT NOT NULL,
    transaction_id xid8 NOT NULL,
    uuid VARCHAR(36) NOT NULL,
    created_at TIMESTAMP NOT NULL,
    payload {{.PayloadType}} DEFAULT NULL,
    metadata JSON DEFAULT NULL,
    partition_key TEXT NOT NULL,
    cause TEXT NOT NULL,
    held_behind BIGINT,
    size INTEGER NOT NULL,
    quarantined_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {{ident .DeadKeyIndex}} ON {{ident .Schema .Dead}} (partition_key, id);
