// Package relaystep lets a harness watch the outbox forwarder's steps
// without growing the outbox's exported API: the bench passes an [Observer]
// in the context given to Forwarder.Run, and the forwarder reports each step
// of each topic's loop to it, with the moment it happened. Nothing is
// observed when the context carries none (the forwarder then pays one nil
// check per step).
package relaystep

import (
	"context"
	"time"
)

// Step is one point of a forwarder loop's cycle.
type Step int

// The steps, in the order a cycle that forwards rows reports them.
const (
	// Begin: a forwarder transaction starts (before it takes a
	// connection from the pool).
	Begin Step = iota
	// Locked: BEGIN and the position's lock returned.
	Locked
	// Cut: the cut's keys were read (with its first page when it fits the
	// round trip).
	Cut
	// Read: a page's rows were read and made into records.
	Read
	// SendStart and SendEnd bound one page's send to the broker (SendEnd
	// is reported from the goroutine that sends).
	SendStart
	SendEnd
	// Update: the position update past the page in flight is sent (with
	// the read of the next page, or after a cut's last page of a new cut
	// and its first page); Acked: it returned and the next page's records
	// were made.
	Update
	Acked
	// Commit: COMMIT is sent; Committed: it returned.
	Commit
	Committed
	// Poll and Polled bound the lock-free look for a new cut that a loop
	// takes, instead of a transaction, after one that forwarded nothing.
	Poll
	Polled
	// PauseStart and PauseEnd bound a wait between two cycles; Woken is
	// reported instead of PauseEnd when a wake-up ended it.
	PauseStart
	PauseEnd
	Woken
)

var names = [...]string{"begin", "locked", "cut", "read", "send-start", "send-end", "update", "acked", "commit", "committed", "poll", "polled", "pause-start", "pause-end", "woken"}

func (s Step) String() string {
	if s < 0 || int(s) >= len(names) {
		return "step?"
	}
	return names[s]
}

// Observer receives the steps of a forwarder: topic's loop reached step at
// at. It is called from the loop's goroutine (SendEnd from the goroutine
// sending the page, while the loop updates the position), so
// it must be safe for concurrent use, and quick.
type Observer func(topic string, step Step, at time.Time)

type key struct{}

// With returns ctx carrying o.
func With(ctx context.Context, o Observer) context.Context {
	return context.WithValue(ctx, key{}, o)
}

// From returns the Observer carried by ctx, or nil.
func From(ctx context.Context) Observer {
	o, _ := ctx.Value(key{}).(Observer)
	return o
}

type serialKey struct{}

// WithSerial returns ctx asking the forwarder given it in Run to work as it
// did before its reads were pipelined, for the bench's same-run baseline:
// a new cut's first page read in a round trip of its own, one cut per
// transaction, and the pause after a transaction that forwarded rows taken
// even when a wake-up came during it.
func WithSerial(ctx context.Context) context.Context {
	return context.WithValue(ctx, serialKey{}, true)
}

// Serial reports whether ctx carries WithSerial.
func Serial(ctx context.Context) bool {
	v, _ := ctx.Value(serialKey{}).(bool)
	return v
}
