package soak

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// metaDLQ marks the events group 1 copies to the dead-letter topic.
const metaDLQ = "soak_dlq"

// producer is the producer service: it writes the business row and gets the
// event to Kafka.
type producer interface {
	// produce makes ev durable and published (at least once); twice=true
	// publishes it a second time concurrently.
	produce(ctx context.Context, ev event, msg *message.Message) error
	// restart kills and restarts the component that publishes to Kafka.
	restart(ctx context.Context) error
	// pending returns how many produced events are not yet on Kafka.
	pending(ctx context.Context) (int, error)
	// dbComponents names the components whose backends the
	// pg_terminate_backend fault targets.
	dbComponents() []string
	close()
	kind() string
}

func eventMessage(id uuid.UUID, ev event) *message.Message {
	body, _ := json.Marshal(payload{EventID: id.String(), Aggregate: ev.aggregate, Seq: ev.seq, Amount: ev.amount, Fail: ev.fail, SleepMS: ev.sleep.Milliseconds(), Block: ev.block})
	msg := message.NewMessage(watermill.NewUUID(), body)
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	msg.Metadata.Set(publisher.MetadataPartitionKey, keyOf(ev.aggregate))
	if ev.dlq {
		msg.Metadata.Set(metaDLQ, "1")
	}
	return msg
}

func (h *harness) kafkaPublisher() (*kafka.Publisher, error) {
	pc, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: h.brokers})
	if err != nil {
		return nil, err
	}
	return kafka.NewPublisher(pc, h.logger)
}

// retry runs fn until it succeeds or ctx ends (faults make single attempts fail).
func retry(ctx context.Context, what string, fn func() error) error {
	var err error
	for attempt := 0; ; attempt++ {
		if err = fn(); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w (last error: %v)", what, ctx.Err(), err)
		case <-time.After(time.Duration(min(attempt+1, 10)) * 20 * time.Millisecond):
		}
	}
}

// kafkaProducer commits the business row, then publishes directly to Kafka
// (no outbox): used until the outbox is available, and as a comparison.
type kafkaProducer struct {
	h    *harness
	pool *pgxpool.Pool
	mu   sync.RWMutex
	pub  *kafka.Publisher
}

func newKafkaProducer(ctx context.Context, h *harness) (*kafkaProducer, error) {
	pool, err := h.pool(ctx, "producer", int32(h.cfg.Producers+2))
	if err != nil {
		return nil, err
	}
	pub, err := h.kafkaPublisher()
	if err != nil {
		pool.Close()
		return nil, err
	}
	return &kafkaProducer{h: h, pool: pool, pub: pub}, nil
}

func (p *kafkaProducer) kind() string { return "kafka (business row, then direct publish)" }

func (p *kafkaProducer) dbComponents() []string { return []string{"producer"} }

func (p *kafkaProducer) produce(ctx context.Context, ev event, msg *message.Message) error {
	id := msg.Metadata.Get(publisher.MetadataEventID)
	if err := retry(ctx, "insert event", func() error {
		_, err := p.pool.Exec(ctx, `INSERT INTO soak_event (event_id, aggregate, seq, amount, fail, sleep_ms) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (event_id) DO NOTHING`,
			id, ev.aggregate, ev.seq, ev.amount, ev.fail, ev.sleep.Milliseconds())
		return err
	}); err != nil {
		return err
	}
	copies := 1
	if ev.double {
		copies = 2
		p.h.doublePublished.Add(1)
	}
	errs := make(chan error, copies)
	for range copies {
		go func() {
			m := msg.Copy()
			errs <- retry(ctx, "publish", func() error {
				p.mu.RLock()
				defer p.mu.RUnlock()
				return p.pub.Publish(p.h.topic, m)
			})
		}()
	}
	for range copies {
		if err := <-errs; err != nil {
			return err
		}
	}
	return nil
}

func (p *kafkaProducer) restart(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	_ = p.pub.Close()
	pub, err := p.h.kafkaPublisher()
	if err != nil {
		return err
	}
	p.pub = pub
	return nil
}

func (p *kafkaProducer) pending(context.Context) (int, error) { return 0, nil }

func (p *kafkaProducer) close() {
	p.mu.Lock()
	_ = p.pub.Close()
	p.mu.Unlock()
	p.pool.Close()
}

// runProducers produces the plan with cfg.Producers workers; worker w owns
// the aggregates a with a % Producers == w and produces their events in
// plan order, one at a time, so each aggregate's events reach the producer
// in sequence order.
func (h *harness) runProducers(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make(chan error, h.cfg.Producers)
	for w := range h.cfg.Producers {
		wg.Go(func() {
			for _, ev := range h.plan {
				if ev.aggregate%h.cfg.Producers != w {
					continue
				}
				id := publisher.NewEventID()
				h.dbGate.RLock() // a failover pauses the producers
				err := h.prod.produce(ctx, ev, eventMessage(id, ev))
				h.dbGate.RUnlock()
				if err != nil {
					errs <- err
					return
				}
				h.produced.Add(1)
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// dlqReplayer republishes the dead-letter topic to the main topic.
type dlqReplayer struct {
	router *message.Router
}

func (h *harness) startDLQReplayer(ctx context.Context) error {
	rpub, err := h.kafkaPublisher()
	if err != nil {
		return err
	}
	subCfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: h.brokers}, "soak-dlq-replay-"+h.runID)
	if err != nil {
		return err
	}
	sub, err := kafka.NewSubscriber(subCfg, h.logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, h.logger)
	if err != nil {
		return err
	}
	router.AddHandler("soak-dlq-replay", h.dlq, sub, h.topic, rpub, func(msg *message.Message) ([]*message.Message, error) {
		m := message.NewMessage(watermill.NewUUID(), msg.Payload)
		for k, v := range msg.Metadata {
			m.Metadata.Set(k, v)
		}
		h.dlqReplayedIDs.Store(msg.Metadata.Get(publisher.MetadataEventID), true)
		return []*message.Message{m}, nil
	})
	go func() {
		if err := router.Run(context.WithoutCancel(ctx)); err != nil {
			h.logf("dlq replayer: %v", err)
		}
	}()
	<-router.Running()
	h.dlqR = &dlqReplayer{router: router}
	return nil
}

func (d *dlqReplayer) close() {
	_ = d.router.Close()
}
