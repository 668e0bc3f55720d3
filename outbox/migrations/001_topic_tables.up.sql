-- The two tables of one outbox topic, column for column as watermill-sql
-- v4's PostgreSQL schema adapter and offsets adapter create them, so the
-- outbox's writers, its Forwarder and watermill-sql subscribers share them.
--
-- transaction_id is the writing transaction's id (pg_current_xact_id()).
-- watermill-sql's readers take only rows whose transaction_id is below the
-- snapshot's xmin, in (transaction_id, "offset") order; the Forwarder reads
-- by snapshot instead (migration 2). Both find a transaction's rows through
-- the primary key, which leads with transaction_id.
--
-- watermill-sql's advisory lock serialises this with a watermill-sql
-- subscriber that initialises the same tables (InitializeSchema, with the
-- lock DefaultSchemaInitializationLock("idemkit_outbox")): concurrent
-- CREATE TABLE IF NOT EXISTS can collide.
SELECT pg_advisory_xact_lock({{.InitLock}});

CREATE TABLE IF NOT EXISTS {{ident .Schema .Messages}} (
    "offset" BIGSERIAL,
    "uuid" VARCHAR(36) NOT NULL,
    "created_at" TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    "payload" {{.PayloadType}} DEFAULT NULL,
    "metadata" JSON DEFAULT NULL,
    "transaction_id" xid8 NOT NULL,
    PRIMARY KEY ("transaction_id", "offset")
);

-- One row per consumer group (a Forwarder's, or a watermill-sql
-- subscriber's): the last (transaction_id, offset) it acknowledged.
CREATE TABLE IF NOT EXISTS {{ident .Schema .Offsets}} (
    consumer_group VARCHAR(255) NOT NULL,
    offset_acked BIGINT,
    last_processed_transaction_id xid8 NOT NULL,
    PRIMARY KEY (consumer_group)
);
