package deduplicator

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Lease is one row of the lease table, as [ListLeases] lists it.
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

// leaseSQL holds the operators' lease statements of one table; lease
// mode's own (take, complete, renew, release) live in internal/leasesql.
type leaseSQL struct {
	list, forceRelease, sweep, sweepCount string
}

func newLeaseSQL(schema, table string) leaseSQL {
	l := ident.Quote(schema, table+"_lease")
	return leaseSQL{
		list: "SELECT event_id, consumer_group, token, taken_at, expires_at, attempts, owner, expires_at <= now() " +
			"FROM " + l + " WHERE ($1 = '' OR consumer_group = $1) AND ($2 = 'all' OR ($2 = 'live') = (expires_at > now())) " +
			"ORDER BY taken_at LIMIT $3",
		forceRelease: "DELETE FROM " + l + " WHERE event_id = $1 AND consumer_group = $2",
		sweep:        "DELETE FROM " + l + " WHERE expires_at < $1",
		sweepCount:   "SELECT count(*) FROM " + l + " WHERE expires_at < $1",
	}
}

// LeaseFilter selects the leases [ListLeases] and [ListLeases]
// list.
type LeaseFilter struct {
	// ConsumerGroup limits the list to one group; "" lists every group.
	ConsumerGroup string
	// State is "live", "expired" or "" (both).
	State string
	// Limit is the most rows returned; 0 means 100.
	Limit int
}

// ListLeases lists the leases of cfg's table, oldest taken first.
func ListLeases(ctx context.Context, db migrate.DBTX, cfg TableConfig, f LeaseFilter) ([]Lease, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
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
	rows, err := db.Query(ctx, newLeaseSQL(cfg.Schema, cfg.Table).list, f.ConsumerGroup, state, f.Limit)
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

// ReleaseLeaseOf deletes the lease of (eventID, group) whoever holds it: an
// operator's action for a lease whose owner is known to be gone. The owner,
// if alive, then fails its completion with a lost lease and writes nothing;
// the next delivery takes a new lease. It reports whether a lease existed.
func ReleaseLeaseOf(ctx context.Context, db migrate.DBTX, cfg TableConfig, eventID uuid.UUID, group string) (bool, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return false, err
	}
	tag, err := db.Exec(ctx, newLeaseSQL(cfg.Schema, cfg.Table).forceRelease, eventID, group)
	if err != nil {
		return false, fmt.Errorf("release lease of event %s: %w", eventID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// LeaseSummary counts the leases of one table, for dashboards and the
// console.
type LeaseSummary struct {
	// Live leases are calls in flight (or owners gone less than a lease
	// ago); Expired ones wait for their event's next delivery.
	Live    int `json:"live"`
	Expired int `json:"expired"`
	// OldestLiveSeconds is how long ago the oldest live lease was taken
	// (0 without one): a call that long, renewed all along.
	OldestLiveSeconds float64 `json:"oldest_live_seconds"`
}

// SummarizeLeases counts the leases of cfg's table in one statement. The
// lease table holds only the calls in flight and the expired leases not
// taken over yet, so it reads few rows.
func SummarizeLeases(ctx context.Context, db migrate.DBTX, cfg TableConfig) (LeaseSummary, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return LeaseSummary{}, err
	}
	var s LeaseSummary
	err := db.QueryRow(ctx, "SELECT count(*) FILTER (WHERE expires_at > now()), count(*) FILTER (WHERE expires_at <= now()), "+
		"coalesce(extract(epoch FROM now() - min(taken_at) FILTER (WHERE expires_at > now())), 0)::float8 FROM "+
		ident.Quote(cfg.Schema, cfg.Table+"_lease")).Scan(&s.Live, &s.Expired, &s.OldestLiveSeconds)
	if err != nil {
		return LeaseSummary{}, fmt.Errorf("summarize leases: %w", err)
	}
	return s, nil
}
