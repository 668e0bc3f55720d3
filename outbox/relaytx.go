package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/relaystep"
)

// cutCache keeps the pages of a cut that did not fit in one transaction, so
// that the next transaction continues it without reading its keys again,
// and the first of those pages already read (ahead), so that the next
// transaction starts sending at once.
type cutCache struct {
	cut   outboxsql.Cut
	next  int    // index of the first page not yet forwarded
	ahead *batch // cut.Pages[next], read by the previous transaction, or nil
}

// pagesAfter returns the cached pages that continue p, and the first one
// already read if it was, or false when the cache does not fit p (another
// instance moved the position, or none).
func (c *cutCache) pagesAfter(p outboxsql.Position) ([]outboxsql.Page, *batch, bool) {
	if p.Cut == nil || c.next == 0 || c.next >= len(c.cut.Pages) ||
		c.cut.From.String() != p.Snapshot.String() || c.cut.To.String() != p.Cut.String() ||
		c.cut.Pages[c.next-1].Last != p.CutOffset {
		return nil, nil, false
	}
	return c.cut.Pages[c.next:], c.ahead, true
}

// forwardTx forwards up to BatchesPerTransaction pages of topic in one
// transaction and reports whether the cut it worked on has pages left.
//
// The transaction locks the forwarder's position row (READ COMMITTED: every
// statement after the lock sees at least what the previous holder
// committed), reads the pages of the cut that continues the position, or of
// a new cut ending at the read's own snapshot (with its first page, in the
// same round trip), then sends page k while it moves the position past it
// and reads page k+1; after a cut's last page, page k+1 is the first of the
// next cut, read with the position update (see sendPages). Page k+1 is
// sent only once page k was acknowledged, which keeps the order. The
// position commits when every page of the transaction was sent; if any
// send fails, the transaction rolls back and all of them are sent again
// later.
func (f *Forwarder) forwardTx(stopCtx context.Context, tables outboxsql.Tables, topic string, logger watermill.LoggerAdapter, cache *cutCache, last *known) (n int, more bool, err error) {
	// The transaction itself is not cancelled by a stop: it gets
	// ShutdownTimeout to finish, so a graceful stop does not resend.
	ctx, cancel := context.WithCancel(context.WithoutCancel(stopCtx))
	defer cancel()
	stopWatch := context.AfterFunc(stopCtx, func() { time.AfterFunc(f.cfg.ShutdownTimeout, cancel) })
	defer stopWatch()
	f.step("begin")
	f.mark(topic, relaystep.Begin)

	conn, err := f.cfg.DB.Acquire(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("acquire a connection: %w", err)
	}
	defer conn.Release()
	tx, pos, err := f.lockPosition(ctx, stopCtx, conn.Conn(), tables, topic)
	if tx == nil || err != nil {
		return 0, false, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))

	*last = known{pos: pos, ok: true}
	f.polls.Add(1)
	f.step("locked")
	f.mark(topic, relaystep.Locked)
	pages, ahead, dead, first, err := f.readCut(ctx, tx, tables, pos, cache)
	if err != nil {
		return 0, false, err
	}
	f.step("cut")
	f.mark(topic, relaystep.Cut)
	if len(pages) == 0 {
		return 0, false, f.closeCut(ctx, tx, tables, topic, pos, last)
	}
	if dead == nil {
		if dead, err = tables.DeadKeys(ctx, tx); err != nil {
			return 0, false, fmt.Errorf("read dead keys: %w", err)
		}
	}
	b := ahead
	if b == nil {
		if b, err = f.readFirstPage(ctx, tx, tables, topic, pages[0], first, dead, logger); err != nil {
			return 0, false, err
		}
	}
	n, pos, err = f.sendPages(ctx, stopCtx, tx, tables, topic, logger, cache, pages, b, dead)
	if err != nil {
		return 0, false, err
	}
	if err := f.commit(ctx, tx, topic, n); err != nil {
		cache.ahead = nil
		return 0, false, err
	}
	*last = known{pos: pos, ok: true}
	logger.Debug("Outbox messages forwarded", watermill.LogFields{"messages": n, "position": pos.Snapshot.String(), "cut_offset": pos.CutOffset})
	return n, pos.Cut != nil, nil
}

// lockPosition begins the transaction on conn and locks the forwarder's
// position row. The wait for the lock ends at once on a stop (nothing was
// sent yet): it then returns a nil transaction and no error. A lock held
// too long by another instance is errLockBusy.
func (f *Forwarder) lockPosition(ctx, stopCtx context.Context, conn *pgx.Conn, tables outboxsql.Tables, topic string) (*outboxsql.Tx, outboxsql.Position, error) {
	lockCtx, stopLock := context.WithCancel(ctx)
	defer stopLock()
	unwatch := context.AfterFunc(stopCtx, stopLock)
	tx, pos, err := tables.BeginLock(lockCtx, conn, f.cfg.Name, f.cfg.limits())
	unwatch()
	if err == nil {
		return tx, pos, nil
	}
	if stopCtx.Err() != nil && lockCtx.Err() != nil {
		return nil, pos, nil
	}
	if outboxsql.IsLockTimeout(err) {
		return nil, pos, errLockBusy
	}
	if pe := positionError(err, topic); pe != err {
		return nil, pos, pe
	}
	return nil, pos, fmt.Errorf("begin and lock position: %w", err)
}

// closeCut commits the position past pos's cut when that cut has nothing
// left to send (a position of watermill-sql's kind that had passed its
// transaction's last row), and does nothing when pos has no cut.
func (f *Forwarder) closeCut(ctx context.Context, tx *outboxsql.Tx, tables outboxsql.Tables, topic string, pos outboxsql.Position, last *known) error {
	if pos.Cut == nil {
		return nil
	}
	closed := outboxsql.Position{Snapshot: *pos.Cut}
	if err := tables.Ack(ctx, tx, f.cfg.Name, closed); err != nil {
		return fmt.Errorf("advance position: %w", err)
	}
	if err := f.commit(ctx, tx, topic, 0); err != nil {
		return err
	}
	*last = known{pos: closed, ok: true}
	return nil
}

// readFirstPage makes the batch of a transaction's first page: from first,
// its rows when the cut's read returned them, else from a read of page.
func (f *Forwarder) readFirstPage(ctx context.Context, tx *outboxsql.Tx, tables outboxsql.Tables, topic string, page outboxsql.Page,
	first []outboxsql.Row, dead map[string]int64, logger watermill.LoggerAdapter) (b *batch, err error) {
	if first != nil {
		b, err = f.makeBatch(ctx, tx, tables, topic, first, dead, logger)
	} else {
		b, err = f.readPage(ctx, tx, tables, topic, page, dead, logger)
	}
	if err != nil {
		return nil, err
	}
	f.mark(topic, relaystep.Read)
	return b, nil
}

// sendPages sends b, the first of pages (of cache.cut), then the pages
// after it, each once the previous one was acknowledged, which keeps the
// order. While the broker works on a page it moves the position past that
// page and reads the next one: the cut's next page, or after the cut's
// last page the first page of a new cut, read in the same round trip as
// the position update (a transaction goes on from cut to cut while rows
// keep coming). It stops after BatchesPerTransaction pages, at a stop, or
// when the new cut is empty, and returns the rows sent and the position
// reached. cache is left holding the cut worked on, the index of its first
// page not sent and that page when it was read ahead.
func (f *Forwarder) sendPages(ctx, stopCtx context.Context, tx *outboxsql.Tx, tables outboxsql.Tables, topic string, logger watermill.LoggerAdapter,
	cache *cutCache, pages []outboxsql.Page, b *batch, dead map[string]int64) (n int, pos outboxsql.Position, err error) {
	cut := cache.cut
	for sentPages, i := 1, 0; ; sentPages, i = sentPages+1, i+1 {
		// Stop is read once per page: whether this page ends the
		// transaction and whether the next one is read ahead must agree,
		// or a stop between the two would leave no page to send next.
		stopping := stopCtx.Err() != nil
		sent := f.startSend(topic, b)

		// While the broker works: move the position past this page and
		// read the next one, even when this transaction ends with this
		// page (the next transaction then starts by sending it).
		last := i == len(pages)-1
		if last {
			pos = outboxsql.Position{Snapshot: cut.To}
		} else {
			pos = outboxsql.Position{Snapshot: cut.From, Cut: &cut.To, CutOffset: pages[i].Last}
		}
		final := sentPages == f.cfg.BatchesPerTransaction || stopping
		var (
			next   *batch
			newCut outboxsql.Cut
			first  []outboxsql.Row
		)
		f.mark(topic, relaystep.Update)
		if last && !final && !f.serial {
			var newDead map[string]int64
			if newCut, newDead, first, err = tables.AckAndReadCut(ctx, tx, f.cfg.Name, pos, f.cfg.BatchSize); err == nil {
				dead = newDead
			}
		} else {
			err = tables.Ack(ctx, tx, f.cfg.Name, pos)
		}
		f.step("acked")
		switch {
		case err != nil:
			err = fmt.Errorf("advance position: %w", err)
		case !last && !stopping:
			next, err = f.readPage(ctx, tx, tables, topic, pages[i+1], dead, logger)
		case len(newCut.Pages) > 0 && first != nil:
			next, err = f.makeBatch(ctx, tx, tables, topic, first, dead, logger)
		case len(newCut.Pages) > 0:
			next, err = f.readPage(ctx, tx, tables, topic, newCut.Pages[0], dead, logger)
		}
		f.mark(topic, relaystep.Acked)
		if sendErr := <-sent; sendErr != nil {
			return 0, pos, fmt.Errorf("send %d messages: %w", b.size(), sendErr)
		}
		f.step("sent")
		if err != nil {
			return 0, pos, err
		}
		n += b.size()
		if final || last && len(newCut.Pages) == 0 {
			cache.next = len(cut.Pages) - len(pages) + i + 1
			cache.ahead = next
			return n, pos, nil
		}
		if last { // go on with the new cut
			*cache = cutCache{cut: newCut}
			cut, pages, i = newCut, newCut.Pages, -1
		}
		b = next
	}
}

// startSend sends b to the broker in a goroutine of its own, and returns
// where the outcome arrives.
func (f *Forwarder) startSend(topic string, b *batch) <-chan error {
	sent := make(chan error, 1)
	if b.size() == 0 { // the page's rows were deleted meanwhile
		sent <- nil
		return sent
	}
	f.mark(topic, relaystep.SendStart)
	go func() {
		err := f.send(topic, b)
		f.mark(topic, relaystep.SendEnd)
		sent <- err
	}()
	return sent
}

// readCut returns the pages of the cut that continues pos, from cache when
// it holds them (with the first one already read ahead, or nil), else from
// a read of the cut, which also returns the rows of its first page (or nil:
// read it with readPage) and the keys with dead rows. The keys are read
// after the cut: a key an operator retried (its rows moved back in one
// commit) is no longer among them whenever its moved rows are in the cut.
// A new cut, the keys and the first page go in one round trip.
func (f *Forwarder) readCut(ctx context.Context, tx *outboxsql.Tx, tables outboxsql.Tables, pos outboxsql.Position, cache *cutCache) (
	pages []outboxsql.Page, ahead *batch, dead map[string]int64, first []outboxsql.Row, err error) {
	pages, ahead, ok := cache.pagesAfter(pos)
	if !ok {
		var cut outboxsql.Cut
		if f.serial {
			cut, dead, err = tables.ReadCutAndDeadKeys(ctx, tx, pos, f.cfg.BatchSize)
		} else {
			cut, dead, first, err = tables.ReadCutDeadKeysAndFirstPage(ctx, tx, pos, f.cfg.BatchSize)
		}
		if err != nil {
			return nil, nil, nil, nil, fmt.Errorf("read cut: %w", err)
		}
		*cache = cutCache{cut: cut}
		pages, ahead = cut.Pages, nil
	}
	cache.ahead = nil
	return pages, ahead, dead, first, nil
}

func (f *Forwarder) commit(ctx context.Context, tx *outboxsql.Tx, topic string, n int) error {
	f.step("commit")
	f.mark(topic, relaystep.Commit)
	err := tx.Commit(ctx)
	f.mark(topic, relaystep.Committed)
	if err != nil {
		return fmt.Errorf("commit position: %w", err)
	}
	f.forwarded.Add(uint64(n))
	f.commits.Add(1)
	return nil
}
