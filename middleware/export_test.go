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
	gc := d.strategy.(*groupMode)
	gc.mu.Lock()
	defer gc.mu.Unlock()
	if gc.open == nil {
		return 0
	}
	return len(gc.open.reqs)
}

// SetLeaseHook makes d's lease mode call f at each phase boundary (see
// leaseMode.hook): tests pause one delivery there and run another. Set it
// before the first message.
func SetLeaseHook(d *Dedup, f func(point string, id uuid.UUID)) {
	d.strategy.(*leaseMode).hook = f
}

// LeaseCompletionsQueued returns how many completions wait for a batch in
// d's lease mode, for tests that arrange a batch's members.
func LeaseCompletionsQueued(d *Dedup) int {
	d.strategy.(*leaseMode).completes.mu.Lock()
	defer d.strategy.(*leaseMode).completes.mu.Unlock()
	return len(d.strategy.(*leaseMode).completes.queue)
}

// LeaseTakesQueued returns how many takes wait for a batch in d's lease
// mode.
func LeaseTakesQueued(d *Dedup) int {
	d.strategy.(*leaseMode).takes.mu.Lock()
	defer d.strategy.(*leaseMode).takes.mu.Unlock()
	return len(d.strategy.(*leaseMode).takes.queue)
}

// LeaseFastShare returns the moving share of fast-path members that were
// done within FastPath, which decides whether takes open the fast path.
func LeaseFastShare(d *Dedup) float64 {
	d.strategy.(*leaseMode).fast.mu.Lock()
	defer d.strategy.(*leaseMode).fast.mu.Unlock()
	return d.strategy.(*leaseMode).fast.share
}
