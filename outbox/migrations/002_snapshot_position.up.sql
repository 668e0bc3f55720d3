-- The forwarder forwards in batches cut between two snapshots (PgQ's rule,
-- see docs/outbox.md "Ordering"): a cut is the rows whose writing
-- transaction is visible in the current snapshot and not in the previous
-- one, sent in "offset" order. Its position is therefore a snapshot:
--
--   position_snapshot  every row whose transaction is visible in it has been
--                      forwarded (NULL: a position of watermill-sql's
--                      (last_processed_transaction_id, offset_acked) kind,
--                      which the forwarder reads as the equivalent snapshot;
--                      the rows upgraded here keep theirs that way, so an
--                      upgrade neither skips nor resends a row);
--   cut_snapshot       the end of the cut being forwarded (NULL: none);
--   cut_offset         the "offset" of the cut's last row forwarded.
--
-- The forwarder keeps last_processed_transaction_id and offset_acked at a
-- position of watermill-sql's kind that it has certainly passed, for a
-- downgrade or a forwarder of the previous release.
ALTER TABLE {{ident .Schema .Offsets}}
    ADD COLUMN IF NOT EXISTS position_snapshot pg_snapshot,
    ADD COLUMN IF NOT EXISTS cut_snapshot pg_snapshot,
    ADD COLUMN IF NOT EXISTS cut_offset BIGINT;

-- Wake-up, opt-in: once enabled (ALTER TABLE ... ENABLE TRIGGER
-- {{.Trigger}}), every INSERT statement into the topic's table notifies the
-- forwarders listening on the topic's channel (ForwarderConfig.Listen) when
-- its transaction commits; PostgreSQL folds a transaction's identical
-- notifications into one. It is created disabled: NOTIFY takes a
-- server-wide lock at commit that serialises the notifying transactions'
-- commits, so only topics with few commits per second should enable it.
CREATE OR REPLACE FUNCTION {{ident .Schema .NotifyFunction}}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify({{.ChannelLiteral}}, '');
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS {{ident .Trigger}} ON {{ident .Schema .Messages}};
CREATE TRIGGER {{ident .Trigger}} AFTER INSERT ON {{ident .Schema .Messages}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{ident .Schema .NotifyFunction}}();
ALTER TABLE {{ident .Schema .Messages}} DISABLE TRIGGER {{ident .Trigger}};
