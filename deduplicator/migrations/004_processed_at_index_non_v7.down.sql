DO $migrate$
BEGIN
    IF (SELECT c.relkind FROM pg_class c WHERE c.oid = to_regclass('{{ident .Schema .Table}}')) = 'p' THEN
        RETURN;
    END IF;
    CREATE INDEX IF NOT EXISTS {{ident (print .Table "_processed_at_idx")}}
        ON {{ident .Schema .Table}} (processed_at);
    DROP INDEX IF EXISTS {{ident .Schema (print .Table "_processed_at_non_v7_idx")}};
END
$migrate$;
