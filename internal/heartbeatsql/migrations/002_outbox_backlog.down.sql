ALTER TABLE {{ident .Schema "idem_heartbeat"}} DROP COLUMN IF EXISTS outbox_backlog;
