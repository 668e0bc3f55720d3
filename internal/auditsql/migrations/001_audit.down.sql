DROP TABLE IF EXISTS {{ident .Schema "idem_audit_message"}};
DROP TABLE IF EXISTS {{ident .Schema "idem_audit"}};
DROP FUNCTION IF EXISTS {{ident .Schema "idem_audit_append_only"}}();
