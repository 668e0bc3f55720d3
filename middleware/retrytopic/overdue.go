package retrytopic

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
)

// ErrHeadOverdue is the error of the log line that reports keys whose first
// event's copy has not come back from the retry path long after its
// not-before time ([KeyOrder.OverdueAfter]).
var ErrHeadOverdue = errors.New("retrytopic: a parked key's first event has not come back from the retry path")

// overdueCheck finds, now and then, the parked keys of one consumer group
// whose first event's copy is overdue: the stall of a retry path that is
// otherwise silent (every later event of those keys parks behind them).
type overdueCheck struct {
	o      *keyOrder
	after  time.Duration
	every  time.Duration
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	last    time.Time // of the last check
	running bool
	logged  time.Time // of the last log line
}

func newOverdueCheck(o *keyOrder, logger watermill.LoggerAdapter) *overdueCheck {
	if o.cfg.OverdueAfter < 0 {
		return nil
	}
	return &overdueCheck{o: o, after: o.cfg.OverdueAfter, every: max(o.cfg.OverdueAfter/4, 5*time.Second), logger: logger}
}

// overdueKey is the most overdue parked key.
type overdueKey struct {
	key, topic string
	head       string
	overdue    time.Duration
}

// maybe checks when the last check is older than every, in the calling
// message's goroutine (one statement), and updates stats. A check that
// fails is logged at debug level and tried again at the next interval.
func (c *overdueCheck) maybe(ctx context.Context, stats *counters) {
	if c == nil {
		return
	}
	now := c.o.now()
	c.mu.Lock()
	if c.running || now.Sub(c.last) < c.every {
		c.mu.Unlock()
		return
	}
	c.running, c.last = true, now
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.running = false
		c.mu.Unlock()
	}()

	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	n, worst, err := c.query(ctx)
	if err != nil {
		c.logger.Debug("Parked keys: overdue check failed", watermill.LogFields{"consumer_group": c.o.cfg.ConsumerGroup, "err": err.Error()})
		return
	}
	stats.overdueKeys.Store(uint64(n))
	if n == 0 {
		return
	}
	c.mu.Lock()
	log := now.Sub(c.logged) >= c.after
	if log {
		c.logged = now
	}
	c.mu.Unlock()
	if log {
		c.logger.Error("Parked keys stalled: their first event's copy has not come back from the retry path, and their later events wait behind it. "+
			"Check that the retry topic's consumers run and their consumer group is stable; to send the copy again, "+
			"run `idemctl retry unblock --group G --overdue D --yes` (retrytopic.Unblock, key by key)", ErrHeadOverdue, watermill.LogFields{
			"consumer_group": c.o.cfg.ConsumerGroup, "overdue_keys": n, "key": worst.key, "head_event_id": worst.head,
			"retry_topic": worst.topic, "overdue": worst.overdue.Truncate(time.Second).String(), "overdue_after": c.after.String(),
		})
	}
}

// query counts the group's keys whose head's copy is overdue by more than
// c.after, and returns the most overdue one.
func (c *overdueCheck) query(ctx context.Context) (int, overdueKey, error) {
	var n int
	var k overdueKey
	var key, topic, head *string
	var secs *float64
	err := c.o.queryRow(ctx, c.o.sql.overdue,
		[]any{c.o.cfg.ConsumerGroup, c.after.Seconds()}, &n, &key, &topic, &head, &secs)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, k, fmt.Errorf("retrytopic: overdue parked keys: %w", err)
	}
	if key != nil {
		k = overdueKey{key: *key, topic: deref(topic), head: deref(head), overdue: seconds(derefF(secs))}
	}
	return n, k, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func derefF(f *float64) float64 {
	if f == nil {
		return 0
	}
	return *f
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
