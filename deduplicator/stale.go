package deduplicator

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/migrate"
)

// horizon is what the stale rule needs to know about the table: which
// events may have lost their claim to the Cleaner.
type horizon struct {
	// retention is the table's recorded retention.
	retention time.Duration
	// cleanedBefore is the highest cutoff the Cleaner has applied (zero:
	// never): claims of events created before it may have been deleted,
	// whatever the retention is now.
	cleanedBefore time.Time
	// groupFirstSeen is when the group was first seen (zero: before the
	// registry existed, i.e. long ago).
	groupFirstSeen time.Time
	// readAt is when it was read.
	readAt time.Time
}

// stale reports whether the claim of an event created at created may have
// been deleted by now, so that a redelivery could apply the event again
// unnoticed: the event is older than the retention minus margin, or older
// than the Cleaner's highest cutoff plus margin, and the group is old
// enough to have lost claims. A group first seen less than the retention
// minus margin ago has lost none (the Cleaner keeps a young group's
// claims), so nothing is stale for it.
func (h horizon) stale(created, now time.Time, margin time.Duration) bool {
	limit := now.Add(-(h.retention - margin))
	if h.groupFirstSeen.After(limit) {
		return false
	}
	return created.Before(limit) || (!h.cleanedBefore.IsZero() && created.Before(h.cleanedBefore.Add(margin)))
}

// staleState caches the horizon between reads.
type staleState struct {
	h  atomic.Pointer[horizon]
	mu sync.Mutex // serialises re-reads
}

// readHorizon reads the table's recorded retention and cleanup horizon and
// the group's first-seen time; the group must be registered. It follows
// the table: a configured TableConfig.Retention is checked by Register at
// start-up, not here, so a running consumer adopts a changed retention (idemctl retention set).
func (d *Deduplicator) readHorizon(ctx context.Context, db migrate.DBTX) (horizon, error) {
	s, err := readSetting(ctx, db, d.cfg.TableConfig)
	if err != nil {
		return horizon{}, err
	}
	first, err := d.groupFirstSeen(ctx, db)
	if err != nil {
		return horizon{}, err
	}
	h := horizon{retention: s.Retention, cleanedBefore: s.CleanedBefore, groupFirstSeen: first, readAt: d.cfg.NowFunc()}
	if d.cfg.StaleMargin >= h.retention {
		return horizon{}, fmt.Errorf("invalid config: StaleMargin: %s must be shorter than the table's retention (%s)", d.cfg.StaleMargin, h.retention)
	}
	return h, nil
}

// loadHorizon reads the horizon in db and keeps it; Register calls it.
func (d *Deduplicator) loadHorizon(ctx context.Context, db migrate.DBTX) error {
	h, err := d.readHorizon(ctx, db)
	if err != nil {
		return err
	}
	old := d.stale.h.Swap(&h)
	switch {
	case old == nil && d.cfg.ReplayHorizon > 0 && d.cfg.ReplayHorizon > h.retention-d.cfg.StaleMargin:
		d.logger.Info("Dedup retention is shorter than the replay horizon: events replayed from further back will be refused as stale (ErrStaleEvent)", watermill.LogFields{
			"retention": h.retention.String(), "stale_margin": d.cfg.StaleMargin.String(), "replay_horizon": d.cfg.ReplayHorizon.String(),
		})
	case old != nil && old.retention != h.retention:
		d.logger.Info("Dedup retention changed", watermill.LogFields{"retention": h.retention.String(), "previous": old.retention.String()})
	}
	return nil
}

// currentHorizon returns the kept horizon, re-reading it on db when it is
// older than RetentionRefreshInterval at now (the caller's clock, the one
// Config.NowFunc stamps the reads with): a retention changed with idemctl
// retention set reaches running consumers within that interval, which is
// what lets the Cleaner apply a shortening safely.
func (d *Deduplicator) currentHorizon(ctx context.Context, db migrate.Beginner, now time.Time) (horizon, error) {
	if h := d.stale.h.Load(); h != nil && h.fresh(now) {
		return *h, nil
	}
	d.stale.mu.Lock()
	defer d.stale.mu.Unlock()
	if h := d.stale.h.Load(); h != nil && h.fresh(now) {
		return *h, nil
	}
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return d.loadHorizon(ctx, tx) })
	if err != nil {
		return horizon{}, fmt.Errorf("deduplicator: re-read the retention: %w", err)
	}
	return *d.stale.h.Load(), nil
}

// fresh reports whether h, read at h.readAt, is still to be used at now: less
// than RetentionRefreshInterval has passed (a clock set back re-reads too).
func (h *horizon) fresh(now time.Time) bool {
	age := now.Sub(h.readAt)
	return age >= 0 && age < RetentionRefreshInterval
}

// CheckStale applies the stale rule to a UUIDv7 event id at now: it
// returns an error wrapping [ErrStaleEvent] when the event's claim may have
// been deleted
// by the Cleaner, so that a redelivery could apply it again unnoticed. That
// is an event older than the table's retention minus [Config.StaleMargin],
// or than the Cleaner's highest cutoff plus the margin, in a consumer group
// first seen long enough ago to have lost claims: a group first seen less
// than that long ago has lost none, so it drains an old backlog normally.
//
// It reads the table's retention and the group on db (the group must be
// registered: [Deduplicator.Register]) at most every
// [RetentionRefreshInterval] of now's clock ([Config.NowFunc]); an error reading them is returned as it is
// (retry the message), never a guess. Ids that are not UUIDv7 carry no
// time and are never stale.
func (d *Deduplicator) CheckStale(ctx context.Context, db migrate.Beginner, eventID uuid.UUID, now time.Time) error {
	if eventID.Version() != 7 {
		return nil
	}
	h, err := d.currentHorizon(ctx, db, now)
	if err != nil {
		return err
	}
	sec, nsec := eventID.Time().UnixTime()
	created := time.Unix(sec, nsec)
	margin := d.cfg.StaleMargin
	if !h.stale(created, now, margin) {
		return nil
	}
	limit := now.Add(-(h.retention - margin))
	cleaned := "never"
	if !h.cleanedBefore.IsZero() {
		cleaned = h.cleanedBefore.UTC().Format(time.RFC3339)
	}
	first := "before the registry (long ago)"
	if !h.groupFirstSeen.IsZero() {
		first = h.groupFirstSeen.UTC().Format(time.RFC3339)
	}
	return fmt.Errorf("%w: %s: created %s, before %s (retention %s minus margin %s) or the cleanup horizon (%s), and consumer group first seen %s: its claim may have been cleaned",
		ErrStaleEvent, eventID, created.UTC().Format(time.RFC3339), limit.UTC().Format(time.RFC3339), h.retention, margin, cleaned, first)
}
