-- Refused while events wait in the table: version 1 keeps no message, so
-- they would be lost. Let the parked keys drain first (idemctl retry parked).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM {{ident .Schema .Table}} WHERE topic IS NULL) THEN
        RAISE EXCEPTION 'parked events wait in the parked-keys table without a copy on a retry topic; let them drain before reverting'
            USING ERRCODE = 'object_in_use';
    END IF;
END $$;
ALTER TABLE {{ident .Schema .Table}}
    ALTER COLUMN topic SET NOT NULL,
    ALTER COLUMN not_before SET NOT NULL,
    DROP COLUMN IF EXISTS metadata,
    DROP COLUMN IF EXISTS payload,
    DROP COLUMN IF EXISTS message_uuid;
