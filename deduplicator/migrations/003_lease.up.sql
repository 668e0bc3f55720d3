-- Leases of lease mode (middleware.LeaseConfig): a delivery that runs its
-- handler without a transaction first takes a lease on (event_id,
-- consumer_group) in a short transaction of its own, then completes it in a
-- second one that deletes the lease, checking its token, and inserts the
-- claim into the processed_event table together with the handler's writes.
-- A row here is a lease in progress: live until expires_at (the database's
-- clock), then free to be taken over, with a new token, by the next
-- delivery. token is the fencing token: a completion whose token is gone
-- writes nothing. A done event has a claim and no lease, so this table stays
-- as small as the calls in flight; the Cleaner removes leases that expired
-- longer than a retention ago (their events were never delivered again).
CREATE TABLE IF NOT EXISTS {{ident .Schema (print .Table "_lease")}} (
    event_id       uuid        NOT NULL,
    consumer_group text        NOT NULL,
    token          uuid        NOT NULL,
    expires_at     timestamptz NOT NULL,
    taken_at       timestamptz NOT NULL DEFAULT now(),
    attempts       integer     NOT NULL DEFAULT 1,
    owner          text        NOT NULL DEFAULT '',
    PRIMARY KEY (event_id, consumer_group)
);
