package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgerrcode"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/internal/relaystep"
)

// minPollInterval is the first wait after a read that found rows; each
// read that finds none doubles it, up to PollInterval.
const minPollInterval = time.Millisecond

// known is the last position a loop saw: its own, or older than the
// truth when another instance moved it since (its cut then holds more
// rows, never fewer).
type known struct {
	pos outboxsql.Position
	ok  bool
}

// loop forwards topic until stopCtx is done. A failed transaction is rolled
// back and retried: its pages are read and sent again. Unless the last
// transaction forwarded rows, it first asks, in one query and without a
// lock, whether a new cut has any row; after a read that found rows it
// starts the next transaction after minPollInterval, or at once when a
// wake-up came while the transaction ran (rows committed meanwhile, likely
// after its cut), and after each read that found none it waits twice as
// long, up to PollInterval. A wake-up (a write in this process, or a NOTIFY) ends a
// wait longer than minPollInterval and starts the doubling again.
//
// A position from another cluster is given to fail, and the loop returns.
func (f *Forwarder) loop(stopCtx context.Context, topic string, wake chan struct{}, fail func(error)) {
	r := &relay{
		f:      f,
		topic:  topic,
		logger: f.logger.With(watermill.LogFields{"topic": topic}),
		tables: f.cfg.Outbox.tables(topic),
		wake:   wake,
		idle:   min(minPollInterval, f.cfg.PollInterval),
	}
	for stopCtx.Err() == nil {
		// A wake-up that came before this read is answered by it.
		select {
		case <-wake:
			r.woken()
		default:
		}
		forward, err := r.askForCut(stopCtx)
		if !forward {
			continue
		}
		var (
			n    int
			more bool
		)
		if err == nil {
			n, more, err = f.forwardTx(stopCtx, r.tables, topic, r.logger, &r.cache, &r.last)
		}
		if isPositionError(err) {
			f.errs.Add(1)
			fail(err)
			return
		}
		if errors.Is(err, errLockBusy) {
			r.forget()
			f.logHolder(stopCtx, r.tables, r.logger, &r.holder)
			continue
		}
		if errors.Is(err, outboxsql.ErrNoPosition) {
			r.forget()
			if err = f.recreatePosition(stopCtx, topic, r.logger); err == nil {
				continue
			}
		}
		r.pause(stopCtx, n, more, err)
	}
}

// relay is the state of one topic's loop between its transactions.
type relay struct {
	f      *Forwarder
	topic  string
	logger watermill.LoggerAdapter
	tables outboxsql.Tables
	wake   chan struct{}
	cache  cutCache
	last   known
	// idle is the wait after the last read: it doubles after each read
	// that found none, up to PollInterval.
	idle time.Duration
	// busy is whether the last transaction forwarded rows: the next one
	// then starts without asking first (while rows keep coming, the
	// question costs a round trip and nearly always says yes).
	busy   bool
	holder int32 // the pid of the last holder of the position's lock logged
}

// woken restarts the doubling: a wake-up says rows are on their way (a
// NOTIFY: committed; a write in this process: committing), so the reads
// after it start again at minPollInterval.
func (r *relay) woken() { r.idle = min(minPollInterval, r.f.cfg.PollInterval) / 2 }

// forget drops what the loop knew of the position and its cut: another
// instance may have moved it, or the transaction that read it failed.
func (r *relay) forget() { r.cache, r.last = cutCache{}, known{} }

// askForCut asks, in one query and without a lock, whether a new cut has
// any row, unless the last transaction forwarded rows or left its cut
// open (then there is no question: a transaction starts). It reports
// whether a transaction is to start now, with the question's error if it
// failed; when the answer was no, it has waited (see sleep) first, and on
// a stop it reports false.
func (r *relay) askForCut(stopCtx context.Context) (forward bool, err error) {
	if !r.last.ok || r.last.pos.Cut != nil || r.busy {
		return true, nil
	}
	f := r.f
	f.polls.Add(1)
	f.mark(r.topic, relaystep.Poll)
	has, err := r.tables.HasRows(stopCtx, f.cfg.DB, r.last.pos, f.cfg.Name)
	f.mark(r.topic, relaystep.Polled)
	switch {
	case stopCtx.Err() != nil:
		return false, nil
	case err != nil:
		return true, fmt.Errorf("look for a cut: %w", err)
	case !has:
		r.idle = f.backoff(r.idle)
		if f.sleep(stopCtx, r.topic, r.wake, r.idle) {
			r.woken()
		}
		return false, nil
	}
	return true, nil
}

// pause waits after a transaction that forwarded n rows (more: its cut
// has pages left) or failed with err. A failed transaction is counted,
// logged and waits its RetryInterval whatever writers do (a serialization
// failure, a race with another forwarder, is retried at once).
func (r *relay) pause(stopCtx context.Context, n int, more bool, err error) {
	f := r.f
	r.busy = err == nil && n > 0
	if err != nil {
		f.errs.Add(1)
		r.forget()
		wait := time.Duration(0)
		if isSerializationFailure(err) {
			r.logger.Debug("Outbox batch conflicted with another forwarder, retrying", watermill.LogFields{"err": err.Error()})
		} else {
			r.logger.Error("Outbox batch failed, retrying", err, watermill.LogFields{"retry_in": f.cfg.RetryInterval.String()})
			wait = f.cfg.RetryInterval
		}
		f.sleep(stopCtx, r.topic, nil, wait)
		return
	}
	if f.sleep(stopCtx, r.topic, r.wake, r.nextWait(n, more)) {
		r.woken()
	}
}

// nextWait is the wait after a transaction that forwarded n rows: none
// while its cut has pages left, minPollInterval after one that forwarded
// rows (none when a wake-up came while it ran), else twice the last wait.
func (r *relay) nextWait(n int, more bool) time.Duration {
	switch {
	case more:
		return 0
	case n > 0:
		r.idle = min(minPollInterval, r.f.cfg.PollInterval)
		if len(r.wake) > 0 && !r.f.serial {
			// A write committed (or a NOTIFY came) during this
			// transaction, perhaps after its cut: read at once.
			return 0
		}
		return r.idle
	default:
		r.idle = r.f.backoff(r.idle)
		return r.idle
	}
}

// backoff is the wait after a read that found nothing: twice the last
// one, up to PollInterval.
func (f *Forwarder) backoff(idle time.Duration) time.Duration {
	return max(min(2*idle, f.cfg.PollInterval), time.Microsecond)
}

// sleep waits d, or until a wake-up on wake (nil: none), and reports
// whether a wake-up ended it. A wait of minPollInterval or less (the pause
// after a read that found rows) is not cut short: while rows keep coming,
// each read takes what arrived during that pause, rather than one read per
// write.
func (f *Forwarder) sleep(stopCtx context.Context, topic string, wake chan struct{}, d time.Duration) (woke bool) {
	if d <= 0 {
		return false
	}
	f.mark(topic, relaystep.PauseStart)
	if d <= minPollInterval {
		wake = nil
	} else if f.stretch != nil {
		d = f.stretch(d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-stopCtx.Done():
	case <-wake:
		f.mark(topic, relaystep.Woken)
		return true
	case <-t.C:
	}
	f.mark(topic, relaystep.PauseEnd)
	return false
}

func isSerializationFailure(err error) bool {
	return pgerr.Has(err, pgerrcode.SerializationFailure, pgerrcode.DeadlockDetected)
}
