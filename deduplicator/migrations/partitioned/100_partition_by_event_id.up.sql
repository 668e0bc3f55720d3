-- Partitioned layout (deduplicator.LayoutPartitioned): processed_event becomes
-- RANGE-partitioned on event_id itself, one partition per UTC day. A UUIDv7
-- sorts by its creation time, so the smallest UUIDv7 of a day's
-- 00:00:00.000 UTC (tttttttt-tttt-7000-8000-000000000000) bounds the day; the
-- same event always lands in the same partition and PRIMARY KEY (event_id,
-- consumer_group) keeps deduplicating. Never partition by processed_at: a
-- redelivery gets a new processed_at, hence a new key, and is applied twice.
--
-- On an existing plain table this converts it in place, keeping every row:
-- the table is locked (ACCESS EXCLUSIVE) for the copy, so run it in a quiet
-- period on a big table. Ids that are not UUIDv7 cannot be placed by time;
-- if any exist the migration stops (nothing changes) and tells how many.
-- Creates today's partition and the next 3 days', one per day that already
-- holds rows (up to 400 days back), and the DEFAULT partition; the Cleaner
-- keeps creating partitions ahead from then on.
DO $migrate$
DECLARE
    parent_kind "char";
    non_v7      bigint;
    pk_name     name;
    today       date := (now() AT TIME ZONE 'UTC')::date;
    d           date;
BEGIN
    SELECT c.relkind INTO parent_kind FROM pg_class c
     WHERE c.oid = to_regclass('{{ident .Schema .Table}}');
    IF parent_kind = 'p' THEN
        RETURN; -- already partitioned
    END IF;

    LOCK TABLE {{ident .Schema .Table}} IN ACCESS EXCLUSIVE MODE;

    SELECT count(*) INTO non_v7 FROM {{ident .Schema .Table}}
     WHERE get_byte(uuid_send(event_id), 6) >> 4 <> 7;
    IF non_v7 > 0 THEN
        RAISE EXCEPTION 'processed_event: % rows have event ids that are not UUIDv7; the partitioned layout places rows by UUIDv7 time', non_v7
            USING ERRCODE = 'check_violation',
                  HINT = 'Let the Cleaner (DeleteNonV7) remove them once older than the retention, or stay on LayoutPlain.';
    END IF;

    -- Free the names the new table needs (index names are per schema).
    SELECT con.conname INTO pk_name FROM pg_constraint con
     WHERE con.conrelid = '{{ident .Schema .Table}}'::regclass AND con.contype = 'p';
    IF pk_name IS NOT NULL THEN
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', '{{ident .Schema .Table}}', pk_name);
    END IF;
    DROP INDEX IF EXISTS {{ident .Schema (print .Table "_processed_at_idx")}};
    ALTER TABLE {{ident .Schema .Table}} RENAME TO {{ident (print .Table "_old")}};

    -- No processed_at index: every UUIDv7 carries its time, partitions are
    -- bounded by event_id, and each index costs WAL on every claim.
    CREATE TABLE {{ident .Schema .Table}} (
        event_id       uuid        NOT NULL,
        consumer_group text        NOT NULL,
        processed_at   timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (event_id, consumer_group)
    ) PARTITION BY RANGE (event_id);

    EXECUTE format('CREATE TABLE %I.%I PARTITION OF %s DEFAULT',
        '{{.Schema}}', '{{.Table}}_default', '{{ident .Schema .Table}}');

    FOR d IN
        SELECT g::date FROM generate_series(today, today + 3, interval '1 day') g
        UNION
        SELECT DISTINCT (to_timestamp((('x' || substr(replace(o.event_id::text, '-', ''), 1, 12))::bit(48)::bigint) / 1000.0) AT TIME ZONE 'UTC')::date
          FROM {{ident .Schema (print .Table "_old")}} o
        ORDER BY 1
    LOOP
        CONTINUE WHEN d < today - 400 OR d > today + 3;
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %s FOR VALUES FROM (%L) TO (%L)',
            '{{.Schema}}', '{{.Table}}_p' || to_char(d, 'YYYYMMDD'), '{{ident .Schema .Table}}',
            (SELECT (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7000-8000-000000000000')::uuid
               FROM lpad(to_hex((extract(epoch FROM d::timestamp AT TIME ZONE 'UTC') * 1000)::bigint), 12, '0') h),
            (SELECT (substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-7000-8000-000000000000')::uuid
               FROM lpad(to_hex((extract(epoch FROM (d + 1)::timestamp AT TIME ZONE 'UTC') * 1000)::bigint), 12, '0') h));
    END LOOP;

    INSERT INTO {{ident .Schema .Table}} (event_id, consumer_group, processed_at)
    SELECT event_id, consumer_group, processed_at FROM {{ident .Schema (print .Table "_old")}};
    DROP TABLE {{ident .Schema (print .Table "_old")}};
END
$migrate$;
