-- Back to the plain layout, keeping every row (the table is locked for the copy).
DO $migrate$
DECLARE
    parent_kind "char";
    pk_name     name;
BEGIN
    SELECT c.relkind INTO parent_kind FROM pg_class c
     WHERE c.oid = to_regclass('{{ident .Schema .Table}}');
    IF parent_kind IS DISTINCT FROM 'p' THEN
        RETURN;
    END IF;
    LOCK TABLE {{ident .Schema .Table}} IN ACCESS EXCLUSIVE MODE;
    SELECT con.conname INTO pk_name FROM pg_constraint con
     WHERE con.conrelid = '{{ident .Schema .Table}}'::regclass AND con.contype = 'p';
    IF pk_name IS NOT NULL THEN
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', '{{ident .Schema .Table}}', pk_name);
    END IF;
    ALTER TABLE {{ident .Schema .Table}} RENAME TO {{ident (print .Table "_old")}};
    CREATE TABLE {{ident .Schema .Table}} (
        event_id       uuid        NOT NULL,
        consumer_group text        NOT NULL,
        processed_at   timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (event_id, consumer_group)
    );
    CREATE INDEX {{ident (print .Table "_processed_at_idx")}} ON {{ident .Schema .Table}} (processed_at);
    INSERT INTO {{ident .Schema .Table}} (event_id, consumer_group, processed_at)
    SELECT event_id, consumer_group, processed_at FROM {{ident .Schema (print .Table "_old")}};
    DROP TABLE {{ident .Schema (print .Table "_old")}}; -- and its partitions
END
$migrate$;
