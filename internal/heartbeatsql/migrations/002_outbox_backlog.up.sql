-- The outbox's pending rows as an instance saw them at its beat (a gauge:
-- instances that share an outbox report the same rows; the series keeps the
-- largest per step). NULL: the instance reports no outbox.
ALTER TABLE {{ident .Schema "idem_heartbeat"}} ADD COLUMN IF NOT EXISTS outbox_backlog bigint;
