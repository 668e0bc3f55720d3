ALTER TABLE {{ident .Schema .Offsets}}
    DROP COLUMN IF EXISTS position_system_identifier,
    DROP COLUMN IF EXISTS position_xmax;
