package middleware

import (
	"errors"
	"time"
)

// Defaults of [GroupCommitConfig].
const (
	// defaultGroupMaxMessages is the largest group.
	defaultGroupMaxMessages = 64
	// defaultGroupMaxWait is how long a group gathers at most.
	defaultGroupMaxWait = 5 * time.Millisecond
	// defaultGroupConcurrency is how many groups run at once.
	defaultGroupConcurrency = 4
)

// GroupCommitConfig turns on group commit: the messages that reach the
// middleware at the same time (watermill-kafka keeps one message in flight
// per partition and runs the partitions concurrently, so with many
// partitions many arrive at once) share one transaction: BEGIN and one
// multi-row claim of their sorted ids in one round trip, duplicates acked
// without running their handlers, each new message's handler run in turn on
// the shared transaction with its own message context, one COMMIT, and only
// then the acks. All of a group's claims and effects commit together or not
// at all, so the guarantees of the one-message mode hold; per-partition
// order is untouched (one message per partition per group). A handler
// sees its message's context values, not its cancellation: the group's
// statements share one connection, which a cancelled statement would end.
//
// A handler error or panic, or a handler that leaves the transaction
// aborted (it swallowed an SQL error: [ErrTxAborted]), rolls the group
// back; that message (the culprit) is processed again alone, in its own
// transaction (a panic is not run again: it is raised in the culprit's
// own delivery, as in transaction mode), and the rest of the group runs
// again as a group (so one poison message costs its group one retry); a message whose handler has
// failed once is processed alone from then on (Retry's attempts,
// redeliveries). A failed
// COMMIT (outcome unknown) nacks every message of the group: redelivery and
// the claims settle it.
//
// What it costs: up to MaxWait of latency while a group gathers (a group
// that stops receiving new messages starts sooner), the handlers of one
// group run one after another, and one failure retries its group. Turn it on
// when an instance consumes many partitions and the database's commit rate
// is the limit; docs/groupcommit.md has the measurements.
type GroupCommitConfig struct {
	// MaxMessages is the largest group. A group runs as soon as it holds
	// its share of the messages in flight, ceil(in flight / Concurrency),
	// at most MaxMessages: n partitions fill Concurrency groups of about
	// n/Concurrency, and a lone message runs at once. Defaults to 64.
	MaxMessages int
	// MaxWait is the longest a group gathers before it runs, for a share
	// that does not come (messages in flight elsewhere); it also runs when
	// no message joined it for a fifth of MaxWait. Defaults to 5 ms.
	MaxWait time.Duration
	// Concurrency is how many groups run at once, each on its own
	// connection, so handler CPU is not serialized through one goroutine.
	// While all are busy, arriving messages gather into the next group.
	// Defaults to 4.
	Concurrency int
}

func (c *GroupCommitConfig) setDefaults() {
	if c.MaxMessages == 0 {
		c.MaxMessages = defaultGroupMaxMessages
	}
	if c.MaxWait == 0 {
		c.MaxWait = defaultGroupMaxWait
	}
	if c.Concurrency == 0 {
		c.Concurrency = defaultGroupConcurrency
	}
}

func (c GroupCommitConfig) validate() error {
	switch {
	case c.MaxMessages < 1:
		return errors.New("Mode.MaxMessages (group commit): must be positive")
	case c.MaxWait < 0:
		return errors.New("Mode.MaxWait (group commit): must not be negative")
	case c.Concurrency < 1:
		return errors.New("Mode.Concurrency (group commit): must be positive")
	}
	return nil
}
