package idemtest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/idemtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// kitTB stands in for the *testing.T your test would pass: it runs the
// cleanups registered by the kit when done is called.
type kitTB struct {
	testing.TB
	cleanups []func()
}

func (*kitTB) Helper()                   {}
func (*kitTB) Name() string              { return "ExampleKafka" }
func (*kitTB) Fatalf(f string, a ...any) { panic(fmt.Sprintf(f, a...)) }
func (t *kitTB) Cleanup(f func())        { t.cleanups = append(t.cleanups, f) }
func (t *kitTB) done() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}

// A handler test against a real broker and a throwaway schema: the event is
// published twice (a redelivery), consumed through the dedup middleware, and
// the handler runs once. In your test, t is the *testing.T and each error is
// checked with require.NoError.
func ExampleKafka() {
	t := &kitTB{} // in a test: t *testing.T
	defer t.done()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	pool, schema := idemtest.Schema(t) // dropped when the test ends
	brokers := idemtest.Kafka(t)       // KAFKA_BROKERS, or an in-process broker
	table := deduplicator.TableConfig{Schema: schema}
	_ = migrate.Up(ctx, pool, deduplicator.MigrationLine(table))
	pubCfg, _ := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: brokers})
	subCfg, _ := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: brokers}, "billing")
	pub, _ := kafka.NewPublisher(pubCfg, nil)
	defer pub.Close()
	sub, _ := kafka.NewSubscriber(subCfg, nil)
	defer sub.Close()
	dedup, _ := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing", Table: table}, nil)

	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"amountCents":1250}`))
	_ = publisher.NewStampingPublisher(pub).Publish("payments", msg) // stamps the event id
	_ = pub.Publish("payments", msg.Copy())                          // the same event again

	runs := 0
	handler := dedup.Middleware(func(m *message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	messages, _ := sub.Subscribe(ctx, "payments")
	for range 2 {
		m := <-messages
		if _, err := handler(m); err != nil {
			panic(err)
		}
		m.Ack()
	}
	id, _ := publisher.ParseEventID(msg.Metadata.Get(publisher.MetadataEventID))
	idemtest.RequireProcessed(ctx, t, pool, table, "billing", id)
	fmt.Println("deliveries: 2, handler runs:", runs)
	// Output:
	// deliveries: 2, handler runs: 1
}
