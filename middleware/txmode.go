package middleware

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
)

// txMode is transaction mode: one transaction per message, BEGIN and the
// claim in one round trip, the handler on that transaction, COMMIT. Group
// commit uses it for the messages it processes alone.
type txMode struct {
	s *steps
	// handlerFailed, when set, is told of each event whose handler
	// returned an error, panicked or left the transaction unusable.
	handlerFailed func(id uuid.UUID)
}

// process processes msg in its own transaction.
func (m *txMode) process(msg *message.Message, h message.HandlerFunc, id uuid.UUID, span *msgSpan) (produced []*message.Message, outcome string, err error) {
	s := m.s
	origCtx := msg.Context()
	defer msg.SetContext(origCtx)
	fields := watermill.LogFields{"event_id": id.String(), "message_uuid": msg.UUID}

	start := time.Now()
	tx, first, err := s.claims.BeginClaim(s.progress.progressContext(origCtx, msg), s.db, s.txOpts, id)
	s.stats.claimed(time.Since(start))
	if err != nil {
		err = fmt.Errorf("dedup: %w", err)
	} else {
		span.claimed(time.Since(start), first)
	}
	if tx == nil {
		s.stats.claimErrors.Add(1)
		return nil, outcomeClaimError, err
	}
	done, handlerFailed := false, false
	defer func() {
		if !done { // error, duplicate or panic
			s.rollback(origCtx, tx, fields)
		}
	}()
	if err != nil {
		s.stats.claimErrors.Add(1)
		return nil, outcomeClaimError, err
	}
	if !first {
		s.stats.duplicates.Add(1)
		s.logger.Debug("Duplicate event skipped", fields)
		return nil, outcomeDuplicate, nil
	}
	defer func() {
		if !done { // handler error or panic, outbox or commit failure
			s.stats.failed.Add(1)
			if handlerFailed && m.handlerFailed != nil {
				m.handlerFailed(id)
			}
		}
	}()

	hooks := &idemctx.Hooks{Tx: tx}
	msg.SetContext(s.handlerContext(origCtx, tx, hooks, msg, id))
	handlerFailed = true // until h returns: an error or a panic
	produced, err = h(msg)
	if err != nil {
		return nil, outcomeFailed, err
	}
	if err := txUsable(tx); err != nil {
		return nil, outcomeFailed, err
	}
	handlerFailed = false
	if produced, err = s.toOutbox(msg.Context(), origCtx, tx, produced); err != nil {
		return nil, outcomeFailed, err
	}
	span.event("commit")
	if err := tx.Commit(origCtx); err != nil {
		// The outcome is unknown (the COMMIT may have reached the server).
		// Returning the error nacks the message; the redelivery's claim
		// tells which way it went.
		return nil, outcomeFailed, fmt.Errorf("dedup: commit: %w", err)
	}
	done = true
	hooks.Committed()
	s.stats.processed.Add(1)
	s.stats.txNanos.Add(uint64(time.Since(start)))
	s.logger.Trace("Event processed", fields.Add(watermill.LogFields{"tx_duration": time.Since(start).String()}))
	return produced, outcomeProcessed, nil
}
