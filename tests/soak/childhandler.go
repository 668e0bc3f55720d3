package soak

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/internal/retryheaders"
	"github.com/idemkit/watermill-idempotency/internal/wait"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// outer sits outside the retry-topic middleware: it reports deliveries,
// applied messages, absorbed duplicates and messages sent along the retry
// path, copies the first group's applied DLQ events to the dead-letter
// topic, and dies after COMMIT when armed.
func (c *child) outer(ctx context.Context) message.HandlerMiddleware {
	return func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			d := &delivery{}
			msg.SetContext(context.WithValue(msg.Context(), stateKey{}, d))
			onRetry := c.isRetryTopic(message.SubscribeTopicFromCtx(msg.Context()))
			if onRetry {
				c.emit(lineDeliveryRetry)
			} else {
				c.emit(lineDelivery)
				c.franzDelivered()
				n := c.handlers.Add(1)
				defer c.handlers.Add(-1)
				if m := c.maxHandlers.Load(); n > m && c.maxHandlers.CompareAndSwap(m, n) {
					c.emit(lineHandlers + strconv.FormatInt(n, 10))
				}
			}
			produced, err := next(msg)
			switch {
			case err != nil:
				c.emit(lineFailed)
				return nil, err
			case !d.reached:
				// KeyOrder: sent behind its key's parked event, or already
				// on the retry path.
				c.emit(lineDeferred)
				return produced, nil
			case d.err != nil:
				// The retry-topic middleware acked a failure (the handler
				// may have run, its transaction did not commit, or its
				// COMMIT's outcome is unknown): moved to the retry topic of
				// the next attempt, or poisoned.
				if _, poisoned := c.poisoned.LoadAndDelete(msg.UUID); !poisoned {
					attempt, _ := strconv.Atoi(msg.Metadata.Get(retrytopic.MetadataAttempt))
					if !onRetry {
						attempt = 0
					}
					topic := message.SubscribeTopicFromCtx(msg.Context())
					c.emit(lineEscalated + strconv.Itoa(attempt+1) + " " + msg.Metadata.Get(publisher.MetadataEventID) + " " + topic + ": " + oneLine(d.err.Error()))
				}
				return produced, nil
			case d.ran && onRetry:
				c.emit(lineAppliedRetry)
			case d.ran:
				c.emit(lineApplied)
			default:
				c.emit(lineDuplicate)
				return produced, nil
			}
			if c.dlqPub != nil && msg.Metadata.Get(metaDLQ) == "1" {
				// As a dead-letter replay does (poison.Replay): without the
				// retry headers of the copy that was applied.
				m := message.NewMessage(watermill.NewUUID(), msg.Payload)
				for k, v := range msg.Metadata {
					if k != metaDLQ && !retryheaders.Has(k) {
						m.Metadata.Set(k, v)
					}
				}
				if err := retry(ctx, "publish to dlq", func() error { return c.dlqPub.Publish(c.cfg.DLQ, m) }); err == nil {
					c.emit(lineDLQ + msg.Metadata.Get(publisher.MetadataEventID))
				}
			}
			if c.allJoined.Load() && c.armed.CompareAndSwap(pendingKillCommit, pendingNone) {
				// COMMIT happened, the ack will not: the next owner gets the
				// message again and must absorb it as a duplicate.
				c.die(faultKillCommit)
			}
			return produced, nil
		}
	}
}

// attempt wraps each in-process attempt (inside watermill's Retry): the
// outer middleware learns whether the chain ran and how its last attempt
// ended.
func (c *child) attempt(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d, _ := msg.Context().Value(stateKey{}).(*delivery)
		if d != nil {
			d.reached, d.ran = true, false
		}
		produced, err := next(msg)
		if d != nil {
			d.err = err
		}
		return produced, err
	}
}

// tapPublisher is the retry-topic middleware's publisher: it reports each
// message published to the poison topic.
type tapPublisher struct {
	message.Publisher
	c *child
}

func (t tapPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := t.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	if topic == t.c.cfg.PoisonTopic {
		for _, m := range msgs {
			t.c.poisoned.Store(m.UUID, true)
			t.c.emit(linePoisoned + m.Metadata.Get(publisher.MetadataEventID) + " " + oneLine(m.Metadata.Get(middleware.ReasonForPoisonedKey)))
		}
	}
	return nil
}

// handler applies the event: one ledger row, registered with
// idem.Complete (in transaction mode it is written at once in the
// middleware's transaction; in lease mode in the completing transaction,
// after the handler returned), or, for the broken handler of the checker's
// own test, written through the pool; in lease mode a call to the fake
// provider; then, for an event planned to fail, the call to a downstream
// that is down for it until it has failed as often as planned. With hostile
// keys, the hot key's events sleep and the failing key's first event fails
// until the soak releases it.
func (c *child) handler(msg *message.Message) error {
	ctx := msg.Context()
	var p payload
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return idem.Permanent(fmt.Errorf("%w: %v", idem.ErrMalformedPayload, err))
	}
	id, _ := idem.EventIDFromContext(ctx)
	d, _ := ctx.Value(stateKey{}).(*delivery)
	ledger := func(ctx context.Context, db interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}) error {
		_, err := db.Exec(ctx, `INSERT INTO soak_ledger (grp, event_id, aggregate, seq, amount, topic, attempt, instance) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
			c.cfg.Group, id, p.Aggregate, p.Seq, p.Amount, message.SubscribeTopicFromCtx(ctx), msg.Metadata.Get(retrytopic.MetadataAttempt), c.cfg.Instance)
		return err
	}
	if c.cfg.Unsafe {
		if err := ledger(ctx, c.pool); err != nil {
			return err
		}
	} else if err := idem.Complete(ctx, func(ctx context.Context, tx pgx.Tx) error {
		if err := ledger(ctx, tx); err != nil {
			return err
		}
		if c.cfg.Lease && d != nil {
			d.ran = true // in the completing transaction: the lease was still ours
		}
		return nil
	}); err != nil {
		return err
	}
	if c.cfg.Lease {
		// Lease mode: no transaction, no connection held during the call.
		if err := c.charge(ctx, id, p); err != nil {
			return err
		}
	}
	if p.SleepMS > 0 {
		// The hot key: a slow handler, holding its transaction.
		if err := wait.Sleep(ctx, time.Duration(p.SleepMS)*time.Millisecond); err != nil {
			return err
		}
	}
	if p.Block {
		// The failing key's first event: nacked until released.
		if err := c.blocked(ctx, id); err != nil {
			return err
		}
	}
	if p.Fail > 0 {
		// After the ledger row: the failure rolls it back (in lease mode,
		// it is never written).
		if err := c.downstream(ctx, id, p.Fail); err != nil {
			return err
		}
	}
	if c.allJoined.Load() && c.armed.CompareAndSwap(pendingKillMid, pendingNone) {
		if c.cfg.Lease {
			// Between the phases: the call returned, the provider charged,
			// the write is registered; the lease is held and nothing is
			// completed. The next delivery takes the lease over once it
			// expires and calls again with the same key.
			c.die(faultKillAfterCall)
		}
		// Inside the transaction: business row written, not committed.
		c.die(faultKillMid)
	}
	if !c.cfg.Lease && d != nil {
		d.ran = true
	}
	return nil
}

// charge calls the fake provider for the event, with its Idempotency-Key
// (the "charge" operation of the group). Armed with a mid-call kill, the
// process dies once the request is sent and the provider is half-way
// through executing it: the charge is made, the lease stays held, and the
// caller never learns the answer.
func (c *child) charge(ctx context.Context, id uuid.UUID, p payload) error {
	body, _ := json.Marshal(chargeRequest{Group: c.cfg.Group, EventID: id.String(), Amount: p.Amount})
	if c.allJoined.Load() && c.armed.CompareAndSwap(pendingKillMidCall, pendingNone) {
		wrote := make(chan struct{})
		var once sync.Once
		tctx := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { once.Do(func() { close(wrote) }) }})
		go func() { _ = c.post(tctx, body) }()
		select {
		case <-wrote:
			time.Sleep(callDuration(id) / 2)
		case <-time.After(5 * time.Second):
		}
		c.die(faultKillMidCall)
	}
	return c.post(ctx, body)
}

// post sends one charge request.
func (c *child) post(ctx context.Context, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.cfg.ProviderURL, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set(headerInstance, c.cfg.Instance)
	if c.cfg.UnstableKey {
		req.Header.Set(idem.IdempotencyKeyHeader, uuid.NewString()) // the transport keeps a key already set
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.client.Do(req)
	if err != nil {
		return fmt.Errorf("soak: provider: %w", err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	switch resp.StatusCode {
	case http.StatusOK:
		return nil
	case http.StatusConflict:
		return errProviderBusy
	}
	return fmt.Errorf("soak: provider: %s", resp.Status)
}

// downstream fails transiently until the event has failed fail times in
// this group. The count is kept in soak_failure, written outside the
// handler's transaction (on downPool), so neither the rollback of the
// failed attempt nor a kill loses it: the plan's failures happen once each,
// on whichever delivery, copy or process comes next.
func (c *child) downstream(ctx context.Context, id uuid.UUID, fail int) error {
	var n int
	err := c.downPool.QueryRow(ctx, `INSERT INTO soak_failure (grp, event_id, failures) VALUES ($1, $2, 1)
ON CONFLICT (grp, event_id) DO UPDATE SET failures = soak_failure.failures + 1 WHERE soak_failure.failures < $3
RETURNING failures`, c.cfg.Group, id, fail).Scan(&n)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil // failed as often as planned: up again
	case err != nil:
		return fmt.Errorf("soak: downstream: %w", err)
	}
	c.emit(lineTransient)
	return fmt.Errorf("%w: downstream unavailable for event %s (planned failure %d of %d)", errPlannedFailure, id, n, fail)
}
