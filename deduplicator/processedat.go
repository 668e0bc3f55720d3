package deduplicator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/migrate"
)

// ProcessedAt reports whether eventID has a committed claim for the group
// and, if so, the claim's processed_at: when the transaction that applied
// the event began.
func (d *Deduplicator) ProcessedAt(ctx context.Context, db migrate.DBTX, eventID uuid.UUID) (at time.Time, ok bool, err error) {
	err = db.QueryRow(ctx, d.processedAtSQL, eventID, d.cfg.ConsumerGroup).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, false, nil
	}
	if err != nil {
		return time.Time{}, false, fmt.Errorf("processed at %s: %w", eventID, notMigrated(err))
	}
	return at, true, nil
}
