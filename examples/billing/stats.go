package main

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// groupStats counts what one consumer group's handler chain saw, around the
// dedup middleware (outer) and the handler (inner).
type groupStats struct {
	dedup *idem.Dedup // processed and skipped: the middleware's own counters

	deliveries, rejected, failed, noRecord atomic.Int64

	mu         sync.Mutex
	ended      map[record]int         // Kafka record -> deliveries of it that ended (acked or poisoned)
	committed  map[string]time.Time   // event id -> when its processing delivery returned
	skipStarts map[string][]time.Time // event id -> when its skipped deliveries started
}

// record is a Kafka record of the consumed topic: each copy of an event is
// one, and a redelivery by Kafka is the same record again.
type record struct {
	partition int32
	offset    int64
}

type ranKey struct{}

// outer wraps the dedup middleware: it counts every delivery and classifies
// what the middleware returned.
func (s *groupStats) outer(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		s.deliveries.Add(1)
		begin := time.Now()
		ctx := msg.Context()
		p, okP := kafka.MessagePartitionFromCtx(ctx)
		o, okO := kafka.MessagePartitionOffsetFromCtx(ctx)
		if !okP || !okO {
			s.noRecord.Add(1)
		}
		ran := new(atomic.Bool)
		msg.SetContext(context.WithValue(ctx, ranKey{}, ran))
		defer msg.SetContext(ctx)
		out, err := h(msg)
		switch {
		case err != nil && idem.IsPermanent(err):
			s.rejected.Add(1) // the poison queue outside publishes it, then acks
			s.end(record{p, o}, msg, begin, "")
		case err != nil:
			s.failed.Add(1) // nacked: the same record comes again
		case ran.Load():
			s.end(record{p, o}, msg, begin, "processed")
		default:
			s.end(record{p, o}, msg, begin, "skipped")
		}
		return out, err
	}
}

// inner sits between the dedup middleware and the handler: it runs only for
// the first claim of an event.
func inner(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if ran, ok := msg.Context().Value(ranKey{}).(*atomic.Bool); ok {
			ran.Store(true)
		}
		return h(msg)
	}
}

// end records a delivery that ended its record: acked (processed or
// skipped) or poisoned (outcome "").
func (s *groupStats) end(r record, msg *message.Message, begin time.Time, outcome string) {
	id := msg.Metadata.Get(publisher.MetadataEventID)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended == nil {
		s.ended, s.committed, s.skipStarts = map[record]int{}, map[string]time.Time{}, map[string][]time.Time{}
	}
	s.ended[r]++
	switch outcome {
	case "skipped":
		s.skipStarts[id] = append(s.skipStarts[id], begin)
	case "processed":
		s.committed[id] = time.Now()
	}
}

// records returns the number of distinct records whose delivery ended.
func (s *groupStats) records() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.ended)
}

// overlapping counts skipped duplicates that started while the copy that
// was processed had not returned yet: they met it in flight.
func (s *groupStats) overlapping() int {
	n := 0
	for id, starts := range s.skipStarts {
		done, ok := s.committed[id]
		for _, t := range starts {
			if ok && t.Before(done) {
				n++
			}
		}
	}
	return n
}

func (s *groupStats) report() groupReport {
	st := s.dedup.Stats()
	s.mu.Lock()
	defer s.mu.Unlock()
	again := 0
	for _, n := range s.ended {
		again += n - 1
	}
	return groupReport{
		Deliveries: s.deliveries.Load(), Processed: st.Processed, Skipped: st.Duplicates,
		Rejected: s.rejected.Load(), Failed: s.failed.Load(),
		MiddlewareErrors: rejected(st.Rejected) + st.Failed + st.ClaimErrors + st.LeasesLost + st.LeasesBusy,
		Records:          len(s.ended), KafkaRedelivered: again, InFlightSkipped: s.overlapping(), NoRecord: s.noRecord.Load(),
	}
}

// auditor records what reached the poison and billing.charged topics.
type auditor struct {
	mu          sync.Mutex
	poison      map[string]map[record]bool // "billing" or "notification" (from handler_poisoned) -> records
	poisonIDs   map[string]map[string]bool // same -> distinct message UUIDs
	reasonSeen  map[string]bool
	reasonsList []string
	charged     map[string]bool // distinct event ids
}

func newAuditor() *auditor {
	return &auditor{
		poison: map[string]map[record]bool{"billing": {}, "notification": {}}, poisonIDs: map[string]map[string]bool{"billing": {}, "notification": {}},
		reasonSeen: map[string]bool{}, charged: map[string]bool{},
	}
}

// record notes a message read from the poison topic (poison) or
// billing.charged. Poison records are counted by (partition, offset), so a
// record the auditor's own group reads twice counts once.
func (a *auditor) record(poison bool, msg *message.Message) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !poison {
		a.charged[msg.Metadata.Get(publisher.MetadataEventID)] = true
		return
	}
	service := "notification"
	if strings.HasPrefix(msg.Metadata.Get(wmw.PoisonedHandlerKey), "billing") {
		service = "billing"
	}
	p, _ := kafka.MessagePartitionFromCtx(msg.Context())
	o, _ := kafka.MessagePartitionOffsetFromCtx(msg.Context())
	a.poison[service][record{p, o}] = true
	a.poisonIDs[service][msg.UUID] = true
	reason := msg.Metadata.Get(wmw.ReasonForPoisonedKey)
	if !a.reasonSeen[reason] {
		a.reasonSeen[reason] = true
		a.reasonsList = append(a.reasonsList, reason)
	}
}

// poisoned counts the poison records of "billing" or "notification".
func (a *auditor) poisoned(service string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.poison[service])
}

// poisonedEvents counts the distinct messages among them.
func (a *auditor) poisonedEvents(service string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.poisonIDs[service])
}

func (a *auditor) poisonedTotal() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.poison["billing"]) + len(a.poison["notification"])
}

func (a *auditor) chargedCount() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.charged)
}

func (a *auditor) reasons() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.reasonsList...)
}

// rejected is the number of messages refused for any reason.
func rejected(r idem.RejectedStats) uint64 {
	var n uint64
	for _, c := range r.ByReason() {
		n += c
	}
	return n
}
