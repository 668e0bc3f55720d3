package dedupsql

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// The registry's errors.
var (
	// ErrGroupExists is returned by [RenameGroup] when the new name is
	// already registered or holds claims.
	ErrGroupExists = errors.New("deduplicator: consumer group already exists")
	// ErrGroupNotFound is returned by [RenameGroup] and [ForgetGroup] for a
	// group that is not registered.
	ErrGroupNotFound = errors.New("deduplicator: consumer group not registered")
)

// Group is a consumer group registered with a table, as recorded.
type Group struct {
	// Name is the consumer group (the second half of the dedup key).
	Name string
	// FirstSeen is when the group's consumers first started on this table
	// (the zero time for groups that held claims before the registry
	// existed: -infinity).
	FirstSeen time.Time
	// IdempotencyNamespace is mixed into named Idempotency-Keys instead of
	// the group's name, so a renamed group keeps its keys.
	IdempotencyNamespace string
	// StartedAt is when a consumer of the group last started.
	StartedAt time.Time
}

// Young reports whether the group was first seen less than retention
// before now: none of its claims can have been cleaned yet, and the
// Cleaner keeps all of them.
func (g Group) Young(now time.Time, retention time.Duration) bool {
	return g.FirstSeen.After(now.Add(-retention))
}

// GroupColumns are the registry's columns [ScanGroup] reads, in order.
const GroupColumns = "consumer_group, first_seen_at, idempotency_namespace, started_at"

// ScanGroup reads a row of [GroupColumns].
func ScanGroup(row pgx.Row) (Group, error) {
	var (
		g     Group
		first pgtype.Timestamptz
	)
	if err := row.Scan(&g.Name, &first, &g.IdempotencyNamespace, &g.StartedAt); err != nil {
		return Group{}, err
	}
	if first.Valid && first.InfinityModifier == pgtype.Finite {
		g.FirstSeen = first.Time
	} // -infinity: the zero time (before every retention)
	return g, nil
}

// Groups returns the consumer groups registered with schema.table, by name.
func Groups(ctx context.Context, db dbx.Querier, schema, table string) ([]Group, error) {
	rows, err := db.Query(ctx, "SELECT "+GroupColumns+" FROM "+Companion(schema, table, GroupSuffix)+" ORDER BY consumer_group")
	if err != nil {
		return nil, fmt.Errorf("read consumer groups of %s: %w", Table(schema, table), err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Group, error) { return ScanGroup(r) })
	if err != nil {
		return nil, fmt.Errorf("read consumer groups of %s: %w", Table(schema, table), err)
	}
	return out, nil
}

// CheckName refuses a group name before any statement runs: the
// deduplicator's ValidateGroupName (a name PostgreSQL cannot store is a
// typed error there). field names the argument in the error.
type CheckName func(field, name string) error

// RenameGroup gives consumer group from's claims and registration to the
// new name to, in one transaction: the claims are copied (so every event
// from applied stays applied for to), and to takes from's first-seen time
// and Idempotency-Key namespace, so the keys of downstream calls do not
// change and a provider recognises a call repeated after the rename. from's
// claims and registration are kept until [ForgetGroup] removes them. It
// returns the new group as recorded and the number of claims copied.
//
// Run it with the consumers of both names stopped, then move the Kafka
// offsets with Kafka's tooling and start the consumers under the new name.
// It returns [ErrGroupNotFound] when from is not registered and
// [ErrGroupExists] when to is registered or holds claims.
func RenameGroup(ctx context.Context, db dbx.Beginner, schema, table, from, to string, check CheckName) (renamed Group, claimsCopied int64, err error) {
	if from == "" || to == "" || from == to {
		return Group{}, 0, errors.New("rename group: from and to must be two different, non-empty names")
	}
	if err := check("from", from); err != nil {
		return Group{}, 0, fmt.Errorf("rename group: %w", err)
	}
	if err := check("to", to); err != nil {
		return Group{}, 0, fmt.Errorf("rename group: %w", err)
	}
	t, grp := Table(schema, table), Companion(schema, table, GroupSuffix)
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		// Serialise with registrations and other renames of these names.
		if _, err := tx.Exec(ctx, "LOCK TABLE "+grp+" IN SHARE ROW EXCLUSIVE MODE"); err != nil {
			return err
		}
		var exists bool
		if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+grp+" WHERE consumer_group = $1) OR EXISTS (SELECT 1 FROM "+
			t+" WHERE consumer_group = $1)", to).Scan(&exists); err != nil {
			return err
		}
		if exists {
			return fmt.Errorf("%w: %q", ErrGroupExists, to)
		}
		g, err := ScanGroup(tx.QueryRow(ctx, "INSERT INTO "+grp+" (consumer_group, first_seen_at, idempotency_namespace)"+
			" SELECT $2, first_seen_at, idempotency_namespace FROM "+grp+" WHERE consumer_group = $1"+
			" RETURNING "+GroupColumns, from, to))
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", ErrGroupNotFound, from)
		}
		if err != nil {
			return err
		}
		renamed = g
		tag, err := tx.Exec(ctx, "INSERT INTO "+t+" (event_id, consumer_group, processed_at)"+
			" SELECT event_id, $2, processed_at FROM "+t+" WHERE consumer_group = $1 ON CONFLICT DO NOTHING", from, to)
		if err != nil {
			return err
		}
		claimsCopied = tag.RowsAffected()
		return nil
	})
	if err != nil {
		return Group{}, 0, fmt.Errorf("rename group %q to %q: %w", from, to, err)
	}
	return renamed, claimsCopied, nil
}

// ForgetGroup deletes a consumer group's claims and registration, in one
// transaction, and returns the number of claims deleted. Use it for a group
// that no longer consumes (after [RenameGroup], or a decommissioned
// service): its claims are dead weight. A consumer of that group started
// afterwards is new: it applies every event it reads again.
func ForgetGroup(ctx context.Context, db dbx.Beginner, schema, table, group string, check CheckName) (int64, error) {
	if err := check("group", group); err != nil {
		return 0, fmt.Errorf("forget group: %w", err)
	}
	var n int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, "DELETE FROM "+Companion(schema, table, GroupSuffix)+" WHERE consumer_group = $1", group)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("%w: %q", ErrGroupNotFound, group)
		}
		tag, err = tx.Exec(ctx, "DELETE FROM "+Table(schema, table)+" WHERE consumer_group = $1", group)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("forget group %q: %w", group, err)
	}
	return n, nil
}
