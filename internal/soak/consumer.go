package soak

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// payload is the JSON body of a soak event.
type payload struct {
	EventID   string `json:"eventId"`
	Aggregate int    `json:"aggregate"`
	Seq       int    `json:"seq"`
	Amount    int64  `json:"amount"`
}

// group is one consumer group: its live router instances and counters.
type group struct {
	h    *harness
	idx  int
	name string
	base int // instances it normally runs

	mu        sync.Mutex // guards live, next; held across an offset reset
	live      []*instance
	next      int
	resetting bool

	deliveries, applied, duplicates, failed atomic.Int64
}

// Pending faults an instance executes on its next applied message.
const (
	pendingNone int32 = iota
	pendingKillMid
	pendingKillCommit
)

type instance struct {
	g       *group
	id      int
	name    string
	pool    *pgxpool.Pool
	router  *message.Router
	pending atomic.Int32
	kill    sync.Once // stop runs once
	stopped chan struct{}
}

// errKilled is returned by a handler whose instance is being killed: the
// message is nacked and redelivered to another instance.
var errKilled = errors.New("soak: instance killed")

type stateKey struct{}

// delivery is shared by the outer middleware and the handler through the
// message context (the dedup middleware keeps the context's values).
type delivery struct{ ran bool }

func (g *group) start(ctx context.Context) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.startLocked(ctx)
}

func (g *group) startLocked(ctx context.Context) error {
	h := g.h
	if g.resetting {
		return nil // the offset reset starts the instances again
	}
	g.next++
	inst := &instance{g: g, id: g.next, stopped: make(chan struct{})}
	inst.name = fmt.Sprintf("%s-i%d", g.name, inst.id)
	maxConns := int32(4)
	if h.cfg.UnsafeLedgerOutsideTx {
		// Each concurrently handled partition holds a transaction and needs
		// a second connection for the unsafe write.
		maxConns = 2*h.cfg.Partitions + 2
	}
	pool, err := h.pool(ctx, inst.name, maxConns)
	if err != nil {
		return err
	}
	inst.pool = pool
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: g.name, Table: h.table}, h.logger)
	if err != nil {
		pool.Close()
		return err
	}
	base := sarama.NewConfig()
	base.ClientID = h.appName(inst.name)
	subCfg, err := publisher.NewKafkaSubscriberConfig(publisher.KafkaConfig{Brokers: h.brokers, Sarama: base}, g.name)
	if err != nil {
		pool.Close()
		return err
	}
	subCfg.NackResendSleep = 50 * time.Millisecond
	sub, err := kafka.NewSubscriber(subCfg, h.logger)
	if err != nil {
		pool.Close()
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, h.logger)
	if err != nil {
		pool.Close()
		return err
	}
	router.AddConsumerHandler("soak-"+inst.name, h.topic, sub, g.outer(inst, dedup.Middleware(g.handler(inst))))
	inst.router = router
	go func() {
		if err := router.Run(context.WithoutCancel(ctx)); err != nil {
			h.logf("%s: router: %v", inst.name, err)
		}
	}()
	select {
	case <-router.Running():
	case <-ctx.Done():
		return ctx.Err()
	}
	g.live = append(g.live, inst)
	return nil
}

// stop closes an instance (gracefully for Kafka: the consumer leaves the
// group; in-flight messages are not acked) and removes it from the group.
func (g *group) stop(inst *instance) {
	inst.kill.Do(func() {
		if p := inst.pending.Swap(pendingNone); p != pendingNone {
			g.rearm(inst, p) // armed but never executed
		}
		if err := inst.router.Close(); err != nil {
			g.h.logf("%s: close: %v", inst.name, err)
		}
		inst.pool.Close()
		g.mu.Lock()
		for i, x := range g.live {
			if x == inst {
				g.live = append(g.live[:i], g.live[i+1:]...)
				break
			}
		}
		g.mu.Unlock()
		close(inst.stopped)
	})
}

// crash stops inst from inside its own handler and replaces it after delay.
func (g *group) crash(ctx context.Context, inst *instance, delay time.Duration) {
	go func() {
		g.stop(inst)
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return
		}
		if err := g.start(ctx); err != nil {
			g.h.violation("%s: restart after crash: %v", g.name, err)
			return
		}
		g.h.fault(faultRestart, false)
	}()
}

// outer sits outside the dedup middleware: it counts deliveries, applied
// messages and absorbed duplicates, runs the kill-after-COMMIT fault, and
// copies group 1's applied events to the dead-letter topic.
func (g *group) outer(inst *instance, next message.HandlerFunc) message.NoPublishHandlerFunc {
	h := g.h
	return func(msg *message.Message) error {
		d := &delivery{}
		ctx := context.WithValue(msg.Context(), stateKey{}, d)
		msg.SetContext(ctx)
		g.deliveries.Add(1)
		_, err := next(msg)
		switch {
		case err != nil && idem.IsPermanent(err):
			h.violation("%s: permanent error (would go to the poison queue): %v", inst.name, err)
			return nil
		case err != nil:
			g.failed.Add(1)
			return err
		case !d.ran:
			g.duplicates.Add(1)
			return nil
		}
		g.applied.Add(1)
		if g.idx == 0 && msg.Metadata.Get(metaDLQ) == "1" {
			h.sendToDLQ(msg)
		}
		if inst.pending.CompareAndSwap(pendingKillCommit, pendingNone) {
			h.fault(faultKillCommit, false)
			// COMMIT happened; the ack will not: the message is redelivered
			// elsewhere and must be absorbed as a duplicate.
			g.crash(context.WithoutCancel(ctx), inst, g.h.crashDelay())
			waitDone(msg.Context())
			return errKilled
		}
		return nil
	}
}

// handler applies the event: one ledger row in the middleware's transaction.
func (g *group) handler(inst *instance) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		var p payload
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, idem.Permanent(fmt.Errorf("%w: %v", idem.ErrMalformedPayload, err))
		}
		id, _ := idem.EventIDFromContext(ctx)
		var db interface {
			Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
		} = idem.MustTxFromContext(ctx)
		if g.h.cfg.UnsafeLedgerOutsideTx {
			db = inst.pool
		}
		if _, err := db.Exec(ctx, `INSERT INTO soak_ledger (grp, event_id, aggregate, seq, amount) VALUES ($1, $2, $3, $4, $5)`,
			g.name, id, p.Aggregate, p.Seq, p.Amount); err != nil {
			return nil, err
		}
		if inst.pending.CompareAndSwap(pendingKillMid, pendingNone) {
			g.h.fault(faultKillMid, false)
			// Inside the transaction, business row written, not committed.
			g.crash(context.WithoutCancel(ctx), inst, g.h.crashDelay())
			waitDone(ctx)
			return nil, errKilled
		}
		if d, ok := ctx.Value(stateKey{}).(*delivery); ok {
			d.ran = true
		}
		return nil, nil
	}
}

// waitDone waits until the subscriber closing cancels the message's
// context, so the message is never acked by this instance.
func waitDone(ctx context.Context) {
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
	}
}

// rearm hands a fault that a stopping instance did not execute to another
// live instance, or counts it as skipped.
func (g *group) rearm(from *instance, p int32) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, inst := range g.live {
		if inst != from && inst.pending.CompareAndSwap(pendingNone, p) {
			return
		}
	}
	kind := faultKillMid
	if p == pendingKillCommit {
		kind = faultKillCommit
	}
	g.h.fault(kind, true)
}

// arm hands fault p to a live instance (chosen by pick) that has none
// pending; it executes it on its next applied message.
func (g *group) arm(pick uint64, p int32) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.resetting {
		return false
	}
	for i := range g.live {
		if g.live[(int(pick%uint64(len(g.live)))+i)%len(g.live)].pending.CompareAndSwap(pendingNone, p) {
			return true
		}
	}
	return false
}
