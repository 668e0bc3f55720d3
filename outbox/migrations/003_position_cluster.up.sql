-- A position knows the cluster it was written on. A snapshot is only
-- meaningful in the transaction-id space it was taken in: after a
-- pg_dump/restore, or a move to a logically replicated copy, rows written
-- on the new cluster get ids below the stored snapshot's and would count as
-- already forwarded. The forwarder writes, with every position:
--
--   position_system_identifier  the cluster's system identifier
--                               (pg_control_system()); NULL: unknown
--                               (written before this migration, or a
--                               watermill-sql subscriber's row);
--   position_xmax               the xmax of the snapshot of the statement
--                               that wrote the position (xid8: epoch
--                               included), which the running cluster's
--                               transaction ids never fall below.
--
-- The forwarder, Backlog and DeleteForwarded refuse a position whose
-- identifier is not the running cluster's, or whose xmax is above the
-- running cluster's; outbox.Reposition (idemctl outbox reposition) resets it.
ALTER TABLE {{ident .Schema .Offsets}}
    ADD COLUMN IF NOT EXISTS position_system_identifier BIGINT,
    ADD COLUMN IF NOT EXISTS position_xmax xid8;
