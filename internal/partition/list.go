package partition

import (
	"bytes"
	"cmp"
	"context"
	"regexp"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Info is one partition of a processed_event table, as [List] reads it.
type Info struct {
	// Name is the partition's table, in the table's schema:
	// <table>_pYYYYMMDD, <table>_default, or any name for one attached by
	// hand.
	Name string
	// Default is true for the DEFAULT partition, which holds the ids outside
	// every other partition.
	Default bool
	// From and To are the creation times of the partition's UUIDv7 bounds:
	// it holds the events created in [From, To), for a daily partition one
	// UTC day. Zero for the DEFAULT partition and bounds that are not
	// UUIDv7 floors.
	From, To time.Time
	// Bound is the partition bound as PostgreSQL prints it: FOR VALUES FROM
	// ('…') TO ('…'), or DEFAULT.
	Bound string
	// Bytes is the partition's size on disk, with its indexes and TOAST
	// (pg_total_relation_size).
	Bytes int64
	// Ranged: FromID and ToID hold the partition's RANGE bounds (any
	// uuid, not only UUIDv7 floors).
	Ranged       bool
	FromID, ToID uuid.UUID
}

var boundRe = regexp.MustCompile(`^FOR VALUES FROM \('([0-9a-f-]{36})'\) TO \('([0-9a-f-]{36})'\)$`)

// List reads the partitions of table (quoted, schema-qualified): the ranged
// ones in the order of their bounds, then the DEFAULT one and any other.
func List(ctx context.Context, db dbx.Querier, table string) ([]Info, error) {
	rows, err := db.Query(ctx, `SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid), pg_total_relation_size(c.oid)
FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1)`, table)
	if err != nil {
		return nil, err
	}
	parts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Info, error) {
		var p Info
		if err := r.Scan(&p.Name, &p.Bound, &p.Bytes); err != nil {
			return p, err
		}
		if p.Bound == "DEFAULT" {
			p.Default = true
			return p, nil
		}
		if m := boundRe.FindStringSubmatch(p.Bound); m != nil {
			p.FromID, p.ToID, p.Ranged = uuid.MustParse(m[1]), uuid.MustParse(m[2]), true
			from, okFrom := Time(p.FromID)
			to, okTo := Time(p.ToID)
			if okFrom && okTo && Floor(from) == p.FromID && Floor(to) == p.ToID {
				p.From, p.To = from, to
			}
		}
		return p, nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(parts, compare)
	return parts, nil
}

// compare orders the ranged partitions by their bounds, then the DEFAULT
// one, then the others by name.
func compare(a, b Info) int {
	if a.Ranged != b.Ranged {
		if a.Ranged {
			return -1
		}
		return 1
	}
	if a.Ranged {
		if c := bytes.Compare(a.FromID[:], b.FromID[:]); c != 0 {
			return c
		}
	}
	if a.Default != b.Default {
		if b.Default {
			return -1
		}
		return 1
	}
	return cmp.Compare(a.Name, b.Name)
}
