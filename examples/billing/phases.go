package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// phase1 confirms cfg.Orders orders (orders row + outbox event in one
// transaction each), loses some provider responses and publishes every n-th
// event a second time; it waits until both groups processed every order.
func (d *demo) phase1(ctx context.Context) error {
	d.orders = make([]Order, d.cfg.Orders)
	for i := range d.orders {
		d.orders[i] = Order{
			ID:          fmt.Sprintf("ord-%05d", i+1),
			CustomerID:  fmt.Sprintf("cus-%03d", i%37+1),
			TotalAmount: fmt.Sprintf("%d.%02d", 10+i%490, i%100),
			Currency:    []string{"EUR", "USD", "GBP"}[i%3],
		}
	}
	// The first lost response is on the first order whose event is
	// published twice: the report prints that order's trace, which then
	// shows a failed attempt, the retry with the same Idempotency-Key and
	// the skipped copy.
	d.traced = 3
	if d.cfg.RedeliverEvery > 0 {
		d.traced = d.cfg.RedeliverEvery - 1
	}
	if len(d.orders) > 0 {
		d.traced %= len(d.orders)
	}
	for i := 0; i < d.cfg.LostResponses && i < len(d.orders); i++ {
		d.provider.DropResponse(d.orders[(d.traced+i*7)%len(d.orders)].ID)
	}
	d.rep.LostResponses = min(d.cfg.LostResponses, len(d.orders))
	d.progress("phase 1: confirming %d orders (orders row + outbox event in one tx), %d lost provider responses, 1 event in %d published twice",
		len(d.orders), d.rep.LostResponses, d.cfg.RedeliverEvery)

	svc := d.orderService()
	start := time.Now()
	var republished atomic.Int64
	var eg errgroup.Group
	eg.SetLimit(4)
	for i, o := range d.orders {
		eg.Go(func() error {
			msg, err := svc.Confirm(ctx, o)
			if err != nil {
				return err
			}
			if i == d.traced {
				d.tracedTrace = otelx.Extract(msg).TraceID() // read after eg.Wait
			}
			if d.cfg.RedeliverEvery > 0 && (i+1)%d.cfg.RedeliverEvery == 0 {
				if err := d.kafkaPub.Publish(d.n.orders, msg.Copy()); err != nil {
					return fmt.Errorf("re-publish: %w", err)
				}
				republished.Add(1)
			}
			return nil
		})
	}
	if err := eg.Wait(); err != nil {
		return err
	}
	d.rep.Republished = int(republished.Load())
	d.rep.Published = len(d.orders) + d.rep.Republished
	confirmed := time.Now()

	n := uint64(len(d.orders))
	if err := d.waitFor(ctx, "phase 1", func() bool {
		return d.billing.dedup.Stats().Processed >= n && d.notification.dedup.Stats().Processed >= n
	}); err != nil {
		return err
	}
	d.rep.BillingSeconds = time.Since(start).Seconds()
	d.rep.BillingEvents = len(d.orders)
	d.rep.BillingBehind = time.Since(confirmed).Seconds()
	d.progress("phase 1: billing charged %d orders in %.1fs: %.0f msg/s, done %.1fs after the last order was confirmed (provider %s per charge, %d partitions, %d instances × MaxInFlight %d)",
		len(d.orders), d.rep.BillingSeconds, float64(len(d.orders))/d.rep.BillingSeconds, d.rep.BillingBehind,
		d.cfg.ProviderLatency, d.cfg.Partitions, d.cfg.BillingInstances, d.cfg.BillingInFlight)
	d.status("phase 1 done")
	return nil
}

// phase4 confirms cfg.ConcurrentDuplicates more orders whose events are also
// published on every partition at once: consumers of different partitions
// claim the same event id concurrently (as after a rebalance or a DLQ
// replay). The provider is slow for these orders, so the first copy is
// still in its call when the others arrive. In billing (lease mode) they
// find its live lease, wait for it (LeaseConfig.BusyWait), then find the event
// done and skip; in notification (transaction mode) their INSERT waits on
// the unique index, then finds the committed row and skips. Then three
// malformed events. It waits until every record is settled.
func (d *demo) phase4(ctx context.Context) error {
	k := d.cfg.ConcurrentDuplicates
	d.progress("phase 4: %d more orders, each event also published on all %d partitions at once; 3 malformed events", k, d.cfg.Partitions)
	extra := make([]Order, k)
	for i := range extra {
		extra[i] = Order{ID: fmt.Sprintf("ord-c%04d", i+1), CustomerID: "cus-c", TotalAmount: fmt.Sprintf("%d.00", 100+i), Currency: "EUR"}
		d.provider.SlowCharge(extra[i].ID, d.cfg.ConcurrentLatency)
	}
	svc := d.orderService()
	var eg errgroup.Group
	for _, o := range extra {
		eg.Go(func() error {
			msg, err := svc.Confirm(ctx, o)
			if err != nil {
				return err
			}
			var wg sync.WaitGroup
			errs := make([]error, d.cfg.Partitions)
			for p := range d.cfg.Partitions {
				c := msg.Copy()
				c.Metadata.Set("demo_partition", strconv.Itoa(int(p)))
				wg.Add(1)
				go func() { defer wg.Done(); errs[p] = d.partPub.Publish(d.n.orders, c) }()
			}
			wg.Wait()
			return errors.Join(errs...)
		})
	}
	if err := eg.Wait(); err != nil {
		return err
	}
	d.rep.ConcurrentSent = k * int(d.cfg.Partitions)
	d.orders = append(d.orders, extra...)
	d.rep.Orders = len(d.orders)

	bad := malformedEvents()
	if err := d.kafkaPub.Publish(d.n.orders, bad...); err != nil {
		return fmt.Errorf("publish malformed: %w", err)
	}
	d.rep.Malformed = len(bad)
	d.rep.Published += k + d.rep.ConcurrentSent + d.rep.Malformed

	if err := d.waitFor(ctx, "phase 4", d.settled); err != nil {
		return err
	}
	d.status("phase 4 done")
	return nil
}

// settled: every record on orders.confirmed was delivered to the end (acked
// or poisoned; failures come again until they end) in both groups, and every
// billing.charged.v1 reached Kafka. The records are counted from Kafka's
// offsets, so a batch the forwarder sent twice is waited for too.
func (d *demo) settled() bool {
	b, nt := d.billing.stats.records(), d.notification.stats.records()
	if b < d.rep.Published || nt < d.rep.Published || d.audit.chargedCount() < len(d.orders) {
		return false
	}
	onTopic, err := topicRecords(d.kclient, d.n.orders)
	if err != nil {
		d.progress("  counting the records on %s: %v", d.n.orders, err)
		return false
	}
	d.rep.OnTopic = onTopic
	return b >= onTopic && nt >= onTopic
}

// orderService writes order.confirmed.v1 to this run's topic.
func (d *demo) orderService() *OrderService {
	return &OrderService{DB: d.pool, Outbox: d.ob, Topic: d.n.orders, TracerProvider: d.providers[serviceOrders]}
}

// waitFor polls cond until it holds, printing progress about once a second.
// It gives up only when ctx (the run's deadline) ends or a background
// service fails.
func (d *demo) waitFor(ctx context.Context, phase string, cond func() bool) error {
	last := time.Now()
	for !cond() {
		select {
		case <-ctx.Done():
			d.status(phase + " (timed out)")
			return fmt.Errorf("%s: %w", phase, ctx.Err())
		case <-d.bgCtx.Done():
			return fmt.Errorf("%s: a background service failed: %w", phase, context.Cause(d.bgCtx))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Since(last) >= time.Second {
			d.status(phase)
			last = time.Now()
		}
	}
	return nil
}

func (d *demo) status(phase string) {
	b, nt, ps := d.billing.stats.report(), d.notification.stats.report(), d.provider.Stats()
	d.progress("%s: outbox forwarded %d · billing %d processed, %d skipped (%d redelivered by Kafka), %d retried · notification %d processed, %d skipped (%d redelivered by Kafka) · provider %d charges, %d replayed · poisoned %d",
		phase, d.fwd.Stats().Forwarded, b.Processed, b.Skipped, b.KafkaRedelivered, b.Failed, nt.Processed, nt.Skipped, nt.KafkaRedelivered, ps.Charges, ps.Replayed, d.audit.poisonedTotal())
}

// partitionMarshaler sends a message to the partition named in its
// "demo_partition" metadata (with a manual partitioner), to put copies of one
// event on several partitions at once.
type partitionMarshaler struct{ idemkafka.Marshaler }

func (m partitionMarshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	pm, err := m.Marshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	p, err := strconv.Atoi(msg.Metadata.Get("demo_partition"))
	if err != nil {
		return nil, fmt.Errorf("demo_partition: %w", err)
	}
	pm.Partition = int32(p)
	return pm, nil
}

// malformedEvents are three messages no redelivery can fix: a bad payload
// with a valid event id (the handler refuses it), no event id at all and a
// non-v7 event id (the middleware refuses both before any transaction).
func malformedEvents() []*message.Message {
	badAmount := publisher.NewEventID()
	m1 := message.NewMessage(badAmount.String(), []byte(fmt.Sprintf(
		`{"eventId":%q,"eventType":"order.confirmed.v1","occurredAt":%q,"aggregateType":"Order","orderId":"ord-bad-1","customerId":"cus-1","totalAmount":"-5.00","currency":"EUR"}`,
		badAmount, time.Now().UTC().Format(time.RFC3339Nano))))
	m1.Metadata.Set(publisher.MetadataEventID, badAmount.String())
	m1.Metadata.Set(publisher.MetadataPartitionKey, "ord-bad-1")

	m2 := message.NewMessage(watermill.NewUUID(), []byte("this is not JSON and has no event id"))
	m2.Metadata.Set(publisher.MetadataPartitionKey, "ord-bad-2")

	v4 := uuid.New()
	m3 := message.NewMessage(v4.String(), []byte(fmt.Sprintf(
		`{"eventId":%q,"eventType":"order.confirmed.v1","occurredAt":%q,"aggregateType":"Order","orderId":"ord-bad-3","customerId":"cus-1","totalAmount":"5.00","currency":"EUR"}`,
		v4, time.Now().UTC().Format(time.RFC3339Nano))))
	m3.Metadata.Set(publisher.MetadataEventID, v4.String())
	m3.Metadata.Set(publisher.MetadataPartitionKey, "ord-bad-3")
	return []*message.Message{m1, m2, m3}
}
