-- Back to watermill-sql's position columns alone, which the forwarder kept
-- at a position it had passed: a forwarder of the previous release resends
-- from there.
DROP TRIGGER IF EXISTS {{ident .Trigger}} ON {{ident .Schema .Messages}};
DROP FUNCTION IF EXISTS {{ident .Schema .NotifyFunction}}();
ALTER TABLE {{ident .Schema .Offsets}}
    DROP COLUMN IF EXISTS position_snapshot,
    DROP COLUMN IF EXISTS cut_snapshot,
    DROP COLUMN IF EXISTS cut_offset;
