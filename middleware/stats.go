package middleware

import (
	"errors"
	"iter"
	"sync/atomic"
	"time"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Stats are the middleware's cumulative counters since [NewDedup]. Read them
// with [Dedup.Stats]; the components/idemprom package exports them to
// Prometheus.
type Stats struct {
	// Processed counts messages whose handler ran and whose transaction
	// committed.
	Processed uint64
	// Duplicates counts messages acked without running the handler because
	// their claim already existed.
	Duplicates uint64
	// Failed counts first-time messages rolled back: the handler returned an
	// error or panicked, or writing the outbox or COMMIT failed.
	Failed uint64
	// ClaimErrors counts messages whose BEGIN or claim failed (connection
	// errors, serialization failures under REPEATABLE READ/SERIALIZABLE).
	ClaimErrors uint64
	// Rejected counts messages refused before any SQL, by reason.
	Rejected RejectedStats
	// ClaimDuration is the total time spent in BEGIN + claim, including the
	// wait for a concurrent claim of the same id; ClaimCount claims were
	// timed.
	ClaimDuration time.Duration
	ClaimCount    uint64
	// TxDuration is the total time from BEGIN to COMMIT of processed
	// messages (Processed of them).
	TxDuration time.Duration
	// Group commit ([GroupCommitConfig]): Groups transactions claimed
	// GroupedMessages messages (so their mean size is the ratio);
	// GroupFallbacks groups were rolled back by a handler failure and their
	// messages processed alone; Alone counts the messages processed in their
	// own transaction after a fallback, a failed group claim or an earlier
	// failure of their handler.
	Groups, GroupedMessages, GroupFallbacks, Alone uint64
	// Lease mode ([LeaseConfig]): LeasesTaken leases were taken (new or
	// taken over), LeasesTakenOver of them from an expired lease;
	// LeasesRenewed renewals succeeded; LeasesLost deliveries found their
	// lease taken over or released and wrote nothing ([ErrLeaseLost]);
	// LeasesBusy deliveries gave up on another delivery's live lease
	// ([ErrLeaseBusy]); LeasesFastPath of the leases taken completed on
	// the fast path (in their take's transaction, no lease row written). A
	// completion batch that fell back to one transaction per message
	// counts in GroupFallbacks.
	LeasesTaken, LeasesTakenOver, LeasesRenewed, LeasesLost, LeasesBusy, LeasesFastPath uint64
	// KafkaAhead counts the records that watermill-kafka's subscriber
	// skipped past the consumer group's position in PostgreSQL: checked at
	// the first message of each partition, and after a jump in its
	// offsets. Records applied on a database that lost them (a failover to
	// an asynchronous standby, a point-in-time restore) count here, and
	// may never be processed: stop the consumers and run idemctl groups
	// progress GROUP --rewind --yes (docs/operations.md). Records the group
	// refused, or found duplicate, just before a restart count too (the
	// rewind is harmless for them: their claims skip them again).
	KafkaAhead uint64
}

// RejectedStats counts refused messages by reason.
type RejectedStats struct {
	MissingEventID, InvalidEventID, NilEventID, NotUUIDv7, EventIDMismatch, Stale uint64
}

// Reasons a message is refused: the keys of [RejectedStats.ByReason], of the
// span attribute idem.reject_reason and of the exporters' reason label.
const (
	reasonMissing  = "missing_event_id"
	reasonInvalid  = "invalid_event_id"
	reasonNil      = "nil_event_id"
	reasonNotV7    = "not_uuidv7"
	reasonMismatch = "event_id_mismatch"
	reasonStale    = "stale"
)

// ByReason yields each reason with its count, every reason in a fixed
// order (zero counts included): missing_event_id, invalid_event_id,
// nil_event_id, not_uuidv7, event_id_mismatch, stale.
func (r RejectedStats) ByReason() iter.Seq2[string, uint64] {
	return func(yield func(string, uint64) bool) {
		_ = yield(reasonMissing, r.MissingEventID) &&
			yield(reasonInvalid, r.InvalidEventID) &&
			yield(reasonNil, r.NilEventID) &&
			yield(reasonNotV7, r.NotUUIDv7) &&
			yield(reasonMismatch, r.EventIDMismatch) &&
			yield(reasonStale, r.Stale)
	}
}

// Add returns the sum of s and o, counter by counter: the stats of several
// middlewares of one consumer group, as the exporters report them.
func (s Stats) Add(o Stats) Stats {
	s.Processed += o.Processed
	s.Duplicates += o.Duplicates
	s.Failed += o.Failed
	s.ClaimErrors += o.ClaimErrors
	s.Rejected.MissingEventID += o.Rejected.MissingEventID
	s.Rejected.InvalidEventID += o.Rejected.InvalidEventID
	s.Rejected.NilEventID += o.Rejected.NilEventID
	s.Rejected.NotUUIDv7 += o.Rejected.NotUUIDv7
	s.Rejected.EventIDMismatch += o.Rejected.EventIDMismatch
	s.Rejected.Stale += o.Rejected.Stale
	s.ClaimDuration += o.ClaimDuration
	s.ClaimCount += o.ClaimCount
	s.TxDuration += o.TxDuration
	s.Groups += o.Groups
	s.GroupedMessages += o.GroupedMessages
	s.GroupFallbacks += o.GroupFallbacks
	s.Alone += o.Alone
	s.LeasesTaken += o.LeasesTaken
	s.LeasesTakenOver += o.LeasesTakenOver
	s.LeasesRenewed += o.LeasesRenewed
	s.LeasesLost += o.LeasesLost
	s.LeasesBusy += o.LeasesBusy
	s.LeasesFastPath += o.LeasesFastPath
	s.KafkaAhead += o.KafkaAhead
	return s
}

// rejectReason classifies a refusal by its sentinel error.
func rejectReason(err error) string {
	switch {
	case errors.Is(err, deduplicator.ErrStaleEvent):
		return reasonStale
	case errors.Is(err, publisher.ErrNotUUIDv7):
		return reasonNotV7
	case errors.Is(err, publisher.ErrNilEventID):
		return reasonNil
	case errors.Is(err, publisher.ErrMissingEventID):
		return reasonMissing
	case errors.Is(err, publisher.ErrEventIDMismatch):
		return reasonMismatch
	default:
		return reasonInvalid
	}
}

type counters struct {
	processed, duplicates, failed, claimErrors  atomic.Uint64
	missing, invalid, nilID, notV7, mismatch    atomic.Uint64
	stale                                       atomic.Uint64
	claimNanos, claimCount, txNanos             atomic.Uint64
	groups, grouped, groupFallbacks, alone      atomic.Uint64
	leasesTaken, leasesTakenOver, leasesRenewed atomic.Uint64
	leasesLost, leasesBusy, leasesFastPath      atomic.Uint64
	kafkaAhead                                  atomic.Uint64
}

func (c *counters) rejected(err error) {
	switch rejectReason(err) {
	case reasonStale:
		c.stale.Add(1)
	case reasonNotV7:
		c.notV7.Add(1)
	case reasonNil:
		c.nilID.Add(1)
	case reasonMissing:
		c.missing.Add(1)
	case reasonMismatch:
		c.mismatch.Add(1)
	default:
		c.invalid.Add(1)
	}
}

func (c *counters) claimed(d time.Duration) {
	c.claimNanos.Add(uint64(d))
	c.claimCount.Add(1)
}

func (c *counters) snapshot() Stats {
	return Stats{
		Processed:   c.processed.Load(),
		Duplicates:  c.duplicates.Load(),
		Failed:      c.failed.Load(),
		ClaimErrors: c.claimErrors.Load(),
		Rejected: RejectedStats{
			MissingEventID: c.missing.Load(), InvalidEventID: c.invalid.Load(),
			NilEventID: c.nilID.Load(), NotUUIDv7: c.notV7.Load(), EventIDMismatch: c.mismatch.Load(), Stale: c.stale.Load(),
		},
		ClaimDuration:   time.Duration(c.claimNanos.Load()),
		ClaimCount:      c.claimCount.Load(),
		TxDuration:      time.Duration(c.txNanos.Load()),
		Groups:          c.groups.Load(),
		GroupedMessages: c.grouped.Load(),
		GroupFallbacks:  c.groupFallbacks.Load(),
		Alone:           c.alone.Load(),
		LeasesTaken:     c.leasesTaken.Load(),
		LeasesTakenOver: c.leasesTakenOver.Load(),
		LeasesRenewed:   c.leasesRenewed.Load(),
		LeasesLost:      c.leasesLost.Load(),
		LeasesBusy:      c.leasesBusy.Load(),
		LeasesFastPath:  c.leasesFastPath.Load(),
		KafkaAhead:      c.kafkaAhead.Load(),
	}
}
