package retrytopic

import (
	"errors"
	"fmt"
)

// The errors of this package; match them with errors.Is.
var (
	// ErrAttemptsExhausted: a transient failure outlasted the last
	// retry-topic attempt; the message was poisoned. [ExhaustedError]
	// unwraps to it and to the last failure.
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

// ExhaustedError is the reason given to a message poisoned because its
// attempts ran out: reason_poisoned carries its text.
type ExhaustedError struct {
	// Attempts is the number of retry-topic attempts made.
	Attempts int
	// Err is the last failure.
	Err error
}

func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("%s after %d retry-topic attempts: %v", ErrAttemptsExhausted, e.Attempts, e.Err)
}

// Unwrap returns ErrAttemptsExhausted and the last failure.
func (e *ExhaustedError) Unwrap() []error { return []error{ErrAttemptsExhausted, e.Err} }
