DROP TABLE IF EXISTS {{ident .Schema "idem_heartbeat"}};
