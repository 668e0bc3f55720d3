ALTER TABLE {{ident .Schema .Messages}}
    ALTER COLUMN "created_at" SET DEFAULT CURRENT_TIMESTAMP;
