package middleware

import (
	"errors"
	"fmt"
	"os"
	"time"
)

// Defaults of [LeaseConfig].
const (
	defaultLeaseDuration    = 30 * time.Second
	defaultLeaseBusyWait    = time.Second
	defaultLeaseMaxBatch    = 256
	defaultLeaseConcurrency = 4
	defaultLeaseFastPath    = 20 * time.Millisecond
)

// LeaseConfig turns on lease mode: the handler runs with no transaction and
// no connection held, so a slow call to a provider costs neither. It is
// Stripe's atomic phases for an event:
//
//  1. take a lease on (event id, consumer group): a short transaction of
//     its own, batched with the other messages arriving meanwhile, that
//     records a fencing token and an expiry on the database's clock and
//     commits. A done event is a duplicate (acked, the handler not run); a
//     live lease of another delivery makes this one wait up to BusyWait and
//     then return [ErrLeaseBusy] (nack, redelivery); an expired lease is
//     taken over with a new token;
//  2. run the handler with no transaction: it makes its call with
//     [IdempotencyKey] (or [NewIdempotencyKeyTransport]), which gives every
//     attempt the same key, and registers its database writes with
//     [Complete]; the lease is renewed every RenewInterval while it runs;
//  3. complete: one transaction, batched too, checks the token (deleting
//     the lease, which it keeps locked until COMMIT), inserts the claim,
//     runs the writes registered with [Complete], writes the returned
//     messages to [Config.Outbox], and commits. A token that lost its lease
//     writes nothing: the middleware returns [ErrLeaseLost].
//
// A handler error releases the lease at once (the redelivery takes a new
// one); a crashed owner's lease expires after Duration and the next
// delivery takes it over. Database effects are applied once per consumer
// group, as in transaction mode; the call is made at least once, always
// with the same Idempotency-Key. docs/guarantees.md lists every
// interleaving and the test that shows it.
//
// The fast path spares a quick handler the lease row: the take's
// transaction stays open for up to FastPath while the batch's handlers
// run, holding each event by an advisory lock instead of a row (another
// delivery's take waits for it). A handler that returns within FastPath
// completes in that transaction, with one commit, as group commit would;
// one still running then gets its lease row, committed with the others'
// claims, and goes on as above. So a session is idle in transaction for
// FastPath at most, and a batch holds one connection meanwhile, whatever
// its size.
//
// Lease mode needs a *pgxpool.Pool (or a *sql.DB: [SQLDB]) as
// [Config.DB]. It batches its own phases, so it does not combine with
// [GroupCommitConfig].
type LeaseConfig struct {
	// Duration is how long a lease lives unless renewed, on the database's
	// clock: how long a crashed owner's event waits before another delivery
	// takes it over. It also bounds each phase's transaction (a server gone
	// without a TCP reset ends in a context deadline error, and the
	// messages are retried). Defaults to 30 s.
	Duration time.Duration
	// RenewInterval is how often a running handler's lease is extended to
	// Duration from then; a renewal that finds the lease taken over cancels
	// the handler's context with [ErrLeaseLost] as its cause. It must be
	// shorter than Duration, with room for a renewal's round trip. Defaults
	// to Duration / 3.
	RenewInterval time.Duration
	// BusyWait is how long a delivery that finds another delivery's live
	// lease waits for it to finish (it takes again after 5 ms, then
	// doubling up to every second, and when that lease would expire)
	// before it returns
	// [ErrLeaseBusy] so the message is redelivered later. Defaults to 1 s;
	// a negative value returns at once.
	BusyWait time.Duration
	// MaxBatch is the most messages one phase's transaction holds: leases
	// taken together, completions committed together. Batches gather only
	// what arrives while the previous ones run, so a lone message waits for
	// nothing. A fast-path take holds an advisory lock per message, so up to
	// MaxBatch × Concurrency of PostgreSQL's shared lock table
	// (max_locks_per_transaction × max_connections entries). Defaults to
	// 256.
	MaxBatch int
	// Concurrency is how many transactions each phase runs at once, each
	// on a connection of its own: the pool needs 2 × Concurrency connections
	// for lease mode, plus one for renewals and releases. Defaults to 4.
	Concurrency int
	// Owner is recorded with each lease for operators (idemctl dedup
	// leases). Defaults to "<hostname>:<pid>".
	Owner string
	// FastPath is how long a take's transaction stays open for its
	// batch's handlers: those that return within it complete in that
	// transaction, without a lease row; the others are given theirs then.
	// It bounds how long lease mode keeps a session idle in transaction,
	// and must be shorter than RenewInterval. While most handlers of the
	// recent fast batches were still running at FastPath (slow calls, for
	// which the open transaction only delays their lease rows), takes
	// write lease rows at once, and their calls are timed: when most of
	// them return within FastPath, the fast path opens again (no take
	// holds a transaction open across a slow call to find out). A negative value turns the fast path off:
	// every event takes a lease row first, and no transaction stays open
	// while a handler runs. Defaults to 20 ms.
	FastPath time.Duration
}

func (c *LeaseConfig) setDefaults() {
	if c.Duration == 0 {
		c.Duration = defaultLeaseDuration
	}
	if c.RenewInterval == 0 {
		c.RenewInterval = c.Duration / 3
	}
	if c.BusyWait == 0 {
		c.BusyWait = defaultLeaseBusyWait
	}
	if c.MaxBatch == 0 {
		c.MaxBatch = defaultLeaseMaxBatch
	}
	if c.Concurrency == 0 {
		c.Concurrency = defaultLeaseConcurrency
	}
	if c.FastPath == 0 {
		c.FastPath = defaultLeaseFastPath
	}
	if c.Owner == "" {
		host, _ := os.Hostname()
		c.Owner = fmt.Sprintf("%s:%d", host, os.Getpid())
	}
}

func (c LeaseConfig) validate() error {
	switch {
	case c.Duration < time.Millisecond:
		return errors.New("Mode.Duration (lease mode): must be at least 1 ms")
	case c.RenewInterval <= 0:
		return errors.New("Mode.RenewInterval (lease mode): must be positive")
	case c.RenewInterval >= c.Duration:
		return fmt.Errorf("Mode.RenewInterval (lease mode): %s must be shorter than Mode.Duration (%s), or the lease expires between renewals", c.RenewInterval, c.Duration)
	case c.MaxBatch < 1:
		return errors.New("Mode.MaxBatch (lease mode): must be positive")
	case c.Concurrency < 1:
		return errors.New("Mode.Concurrency (lease mode): must be positive")
	case c.FastPath >= c.RenewInterval:
		return fmt.Errorf("Mode.FastPath (lease mode): %s must be shorter than Mode.RenewInterval (%s): it is the longest a take's transaction stays open", c.FastPath, c.RenewInterval)
	}
	return nil
}

// leaseConns is how many connections lease mode may hold at once.
func (c LeaseConfig) leaseConns() int { return 2*c.Concurrency + 1 }
