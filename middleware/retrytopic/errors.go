package retrytopic

import (
	"errors"
	"fmt"
)

// The errors of this package; match them with errors.Is.
var (
	// ErrAttemptsExhausted: a transient failure outlasted the last
	// retry-topic attempt; the message was poisoned. The reason it is
	// poisoned with wraps it and the last failure (errors.Is matches both),
	// and reads "retry attempts exhausted after N retry-topic attempts:
	// <last failure>" in reason_poisoned.
	ErrAttemptsExhausted = errors.New("retry attempts exhausted")
	// ErrInvalidHeaders: a message consumed from a retry topic lacks the
	// retry headers or has malformed ones; it is poisoned without running
	// the handler.
	ErrInvalidHeaders = errors.New("invalid retry headers")
	// ErrKeyNotParked: [Unblock] found no parked event of the key.
	ErrKeyNotParked = errors.New("key not parked")
	// ErrKeyOrderUnordered: [Config.KeyOrder] received a message of an
	// parallel.Subscriber with OrderNone, which hands out the events of a
	// key in any order, so a key's later event could pass its parked one.
	// The message is nacked without being applied, moved or poisoned; use
	// OrderKey or OrderPartition.
	ErrKeyOrderUnordered = errors.New("retrytopic: KeyOrder needs an ordered subscriber: parallel.Subscriber with OrderNone refused (use OrderKey or OrderPartition)")
)

// exhausted is the reason given to a message poisoned because its attempts
// ran out: it wraps ErrAttemptsExhausted and err, the last failure.
func exhausted(attempts int, err error) error {
	return fmt.Errorf("%w after %d retry-topic attempts: %w", ErrAttemptsExhausted, attempts, err)
}
