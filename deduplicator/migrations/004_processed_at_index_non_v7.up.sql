-- The processed_at index is needed only for ids that are not UUIDv7: a v7 id
-- carries its creation time, so the Cleaner deletes v7 claims by event_id
-- range through the primary key (and the partitioned layout drops whole
-- partitions). Every index on this table is written by every claim, so the
-- full index becomes a partial one over the non-v7 rows alone, the predicate
-- the Cleaner's DeleteNonV7 query states: a v7 claim (the default; the only
-- kind the partitioned layout and AllowNonV7=false accept) writes the heap
-- and the primary key, nothing else. The partitioned layout has no
-- processed_at index: nothing to do there.
DO $migrate$
BEGIN
    IF (SELECT c.relkind FROM pg_class c WHERE c.oid = to_regclass('{{ident .Schema .Table}}')) = 'p' THEN
        RETURN;
    END IF;
    CREATE INDEX IF NOT EXISTS {{ident (print .Table "_processed_at_non_v7_idx")}}
        ON {{ident .Schema .Table}} (processed_at)
        WHERE get_byte(uuid_send(event_id), 6) >> 4 <> 7;
    DROP INDEX IF EXISTS {{ident .Schema (print .Table "_processed_at_idx")}};
END
$migrate$;
