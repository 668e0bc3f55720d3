package middleware

import (
	"context"

	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
)

// ConsumerGroupFromContext returns the consumer group the middleware claims
// for, for tests that check which group a handler ran under.
func ConsumerGroupFromContext(ctx context.Context) (string, bool) {
	v := idemctx.From(ctx)
	if v == nil {
		return "", false
	}
	return v.ConsumerGroup, true
}

// OpenGroupSize returns how many messages the open (gathering) group holds,
// for tests that arrange a group's members deterministically.
func OpenGroupSize(d *Dedup) int {
	d.gc.mu.Lock()
	defer d.gc.mu.Unlock()
	if d.gc.open == nil {
		return 0
	}
	return len(d.gc.open.reqs)
}

// SetLeaseHook makes d's lease mode call f at each phase boundary (see
// leaseMode.hook): tests pause one delivery there and run another. Set it
// before the first message.
func SetLeaseHook(d *Dedup, f func(point string, id uuid.UUID)) {
	d.lease.hook = f
}

// LeaseCompletionsQueued returns how many completions wait for a batch in
// d's lease mode, for tests that arrange a batch's members.
func LeaseCompletionsQueued(d *Dedup) int {
	d.lease.completes.mu.Lock()
	defer d.lease.completes.mu.Unlock()
	return len(d.lease.completes.queue)
}

// LeaseTakesQueued returns how many takes wait for a batch in d's lease
// mode.
func LeaseTakesQueued(d *Dedup) int {
	d.lease.takes.mu.Lock()
	defer d.lease.takes.mu.Unlock()
	return len(d.lease.takes.queue)
}

// LeaseFastShare returns the moving share of fast-path members that were
// done within FastPath, which decides whether takes open the fast path.
func LeaseFastShare(d *Dedup) float64 {
	d.lease.fast.mu.Lock()
	defer d.lease.fast.mu.Unlock()
	return d.lease.fast.share
}
