package leasesql

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// The operators' statements on a lease table (idemctl dedup leases and
// release, its console; the Cleaner's sweep is deduplicator's): schema and table name the
// processed_event table, "" for the defaults.

// Lease is one row of the lease table, as [List] lists it.
type Lease struct {
	EventID       uuid.UUID `json:"event_id"`
	ConsumerGroup string    `json:"consumer_group"`
	Token         uuid.UUID `json:"token"`
	TakenAt       time.Time `json:"taken_at"`
	ExpiresAt     time.Time `json:"expires_at"`
	Attempts      int       `json:"attempts"`
	Owner         string    `json:"owner"`
	// Expired: the lease is past expires_at on the database's clock; the
	// next delivery of its event takes it over.
	Expired bool `json:"expired"`
}

// Filter selects the leases [List] lists.
type Filter struct {
	// ConsumerGroup limits the list to one group; "" lists every group.
	ConsumerGroup string
	// State is "live", "expired" or "" (both).
	State string
	// Limit is the most rows returned; 0 means 100.
	Limit int
}

// leaseTable returns the quoted lease table of schema.table.
func leaseTable(schema, table string) string {
	schema, table = claimsql.Names(schema, table)
	return ident.Quote(schema, table+"_lease")
}

// List lists the leases of schema.table, oldest taken first.
func List(ctx context.Context, db dbx.Querier, schema, table string, f Filter) ([]Lease, error) {
	state := f.State
	switch state {
	case "":
		state = "all"
	case "live", "expired":
	default:
		return nil, fmt.Errorf("list leases: state %q: want live, expired or empty", f.State)
	}
	if f.Limit == 0 {
		f.Limit = 100
	}
	rows, err := db.Query(ctx, "SELECT event_id, consumer_group, token, taken_at, expires_at, attempts, owner, expires_at <= now() "+
		"FROM "+leaseTable(schema, table)+" WHERE ($1 = '' OR consumer_group = $1) AND ($2 = 'all' OR ($2 = 'live') = (expires_at > now())) "+
		"ORDER BY taken_at LIMIT $3", f.ConsumerGroup, state, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("list leases: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Lease, error) {
		var l Lease
		err := r.Scan(&l.EventID, &l.ConsumerGroup, &l.Token, &l.TakenAt, &l.ExpiresAt, &l.Attempts, &l.Owner, &l.Expired)
		return l, err
	})
	if err != nil {
		return nil, fmt.Errorf("list leases: %w", err)
	}
	return out, nil
}

// ForceRelease deletes the lease of (eventID, group) whoever holds it: an
// operator's action for a lease whose owner is known to be gone. The owner,
// if alive, then fails its completion with [Lost] and writes nothing; the
// next delivery takes a new lease. It reports whether a lease existed.
func ForceRelease(ctx context.Context, db dbx.Querier, schema, table string, eventID uuid.UUID, group string) (bool, error) {
	tag, err := db.Exec(ctx, "DELETE FROM "+leaseTable(schema, table)+" WHERE event_id = $1 AND consumer_group = $2", eventID, group)
	if err != nil {
		return false, fmt.Errorf("release lease of event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// Summary counts the leases of one table, for the console.
type Summary struct {
	// Live leases are calls in flight (or owners gone less than a lease
	// ago); Expired ones wait for their event's next delivery.
	Live    int `json:"live"`
	Expired int `json:"expired"`
	// OldestLiveSeconds is how long ago the oldest live lease was taken
	// (0 without one): a call that long, renewed all along.
	OldestLiveSeconds float64 `json:"oldest_live_seconds"`
}

// Summarize counts the leases of schema.table in one statement. The lease
// table holds only the calls in flight and the expired leases not taken
// over yet, so it reads few rows.
func Summarize(ctx context.Context, db dbx.Querier, schema, table string) (Summary, error) {
	var s Summary
	err := db.QueryRow(ctx, "SELECT count(*) FILTER (WHERE expires_at > now()), count(*) FILTER (WHERE expires_at <= now()), "+
		"coalesce(extract(epoch FROM now() - min(taken_at) FILTER (WHERE expires_at > now())), 0)::float8 FROM "+
		leaseTable(schema, table)).Scan(&s.Live, &s.Expired, &s.OldestLiveSeconds)
	if err != nil {
		return Summary{}, fmt.Errorf("summarize leases: %w", err)
	}
	return s, nil
}
