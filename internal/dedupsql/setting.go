package dedupsql

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// Suffixes of a processed_event table's companion tables (its migration
// 002).
const (
	SettingSuffix = "_setting"
	GroupSuffix   = "_group"
)

// RefreshInterval is how often a running consumer re-reads the recorded
// retention (deduplicator.RetentionRefreshInterval): [SetRetention] keeps a
// shortening from the Cleaner for twice this long.
const RefreshInterval = time.Minute

// ErrTableMissing: the processed_event table does not exist (or is not a
// table); deduplicator.ErrTableMissing is this value.
var ErrTableMissing = errors.New("deduplicator: processed_event table does not exist")

// Table returns schema.table quoted, with the defaults for "" names.
func Table(schema, table string) string {
	schema, table = claimsql.Names(schema, table)
	return ident.Quote(schema, table)
}

// Companion returns the companion table of schema.table with suffix
// ([SettingSuffix], [GroupSuffix]), quoted.
func Companion(schema, table, suffix string) string {
	schema, table = claimsql.Names(schema, table)
	return ident.Quote(schema, table+suffix)
}

// Setting is a table's recorded retention state (<table>_setting).
type Setting struct {
	// Retention is the recorded retention; Previous the one before the
	// last change (0 when never changed), changed at UpdatedAt.
	Retention, Previous time.Duration
	UpdatedAt           time.Time
	// CleanedBefore is the highest cutoff the Cleaner has applied (zero:
	// never).
	CleanedBefore time.Time
}

// ReadSetting reads the retention state recorded with schema.table. Its
// error is PostgreSQL's, unwrapped, for the caller to word.
func ReadSetting(ctx context.Context, db dbx.Querier, schema, table string) (Setting, error) {
	var (
		s             Setting
		us, prevUS    *int64
		cleanedBefore pgtype.Timestamptz
	)
	err := db.QueryRow(ctx, "SELECT (extract(epoch FROM retention) * 1000000)::bigint, (extract(epoch FROM previous_retention) * 1000000)::bigint, updated_at, cleaned_before FROM "+
		Companion(schema, table, SettingSuffix)).Scan(&us, &prevUS, &s.UpdatedAt, &cleanedBefore)
	if err != nil {
		return Setting{}, err
	}
	s.Retention = time.Duration(*us) * time.Microsecond
	if prevUS != nil {
		s.Previous = time.Duration(*prevUS) * time.Microsecond
	}
	if cleanedBefore.Valid && cleanedBefore.InfinityModifier == pgtype.Finite {
		s.CleanedBefore = cleanedBefore.Time
	}
	return s, nil
}

// SetRetention changes the retention recorded with schema.table, for every
// component: running consumers re-read it within [RefreshInterval].
//
//   - Lengthening takes effect at once. Claims the Cleaner already deleted
//     under the shorter retention do not come back: the table records the
//     highest cutoff the Cleaner applied, and the stale guard keeps refusing
//     events created before it.
//   - Shortening takes effect for the Cleaner only 2 × RefreshInterval
//     later (it keeps the previous, longer value until then), so that no
//     running consumer still guards with the longer value while the Cleaner
//     deletes at the shorter one.
func SetRetention(ctx context.Context, db dbx.Querier, schema, table string, retention time.Duration) error {
	if retention <= 0 {
		return errors.New("retention: must be positive")
	}
	// previous_retention is what the Cleaner applies until every consumer has
	// re-read the change: within that window of an earlier change, keep the
	// longest value some consumer may still hold (30 → 7 → 1 days quickly
	// keeps 30).
	_, err := db.Exec(ctx, "UPDATE "+Companion(schema, table, SettingSuffix)+
		" SET previous_retention = CASE WHEN previous_retention IS NOT NULL AND updated_at > now() - interval '1 microsecond' * $2"+
		" THEN greatest(previous_retention, retention) ELSE retention END,"+
		" retention = interval '1 microsecond' * $1, updated_at = now()", retention.Microseconds(), (2 * RefreshInterval).Microseconds())
	if err != nil {
		return fmt.Errorf("set retention of %s: %w", Table(schema, table), err)
	}
	return nil
}
