package poison_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// BenchmarkReadPageOf100k opens the first page (50 records) and a page in
// the middle of a 100,000-record poison topic of 4 partitions, as the
// console's explorer does: each page reads a bounded range per partition,
// never the topic whole; whole-topic reads it all, as poison.List does.
// go test -run '^$' -bench ReadPageOf100k -benchtime 20x ./components/poison/
func BenchmarkReadPageOf100k(b *testing.B) {
	const records, partitions = 100_000, 4
	broker := kafkatest.Start(b)
	kc := idemkafka.ClientConfig{Brokers: broker.Addrs}
	topic := broker.Topic(b, "orders-poison", partitions)
	produce(b, kc, topic, records)

	first, err := poison.ReadPage(context.Background(), poison.PageConfig{Kafka: kc, Topic: topic})
	if err != nil {
		b.Fatal(err)
	}
	if first.Depth != records || len(first.Records) != 50 {
		b.Fatalf("depth %d, %d records on the first page", first.Depth, len(first.Records))
	}
	middle := map[int32]int64{}
	for p, oldest := range first.Oldest {
		middle[p] = (oldest + first.Newest[p]) / 2
	}
	for _, bc := range []struct {
		name string
		from map[int32]int64
	}{{"first", nil}, {"middle", middle}} {
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				p, err := poison.ReadPage(context.Background(), poison.PageConfig{Kafka: kc, Topic: topic, From: bc.from})
				if err != nil {
					b.Fatal(err)
				}
				if len(p.Records) != 50 {
					b.Fatalf("%d records", len(p.Records))
				}
			}
		})
	}
	// The whole topic, as poison.List reads it: the same-run reference.
	b.Run("whole-topic", func(b *testing.B) {
		for b.Loop() {
			res, err := poison.List(context.Background(), poison.Config{Kafka: kc, Topic: topic}, nil)
			if err != nil {
				b.Fatal(err)
			}
			if res.Scanned != records {
				b.Fatalf("%d scanned", res.Scanned)
			}
		}
	})
}

// produce writes n poison records to topic in batches, keyed over its
// partitions.
func produce(b *testing.B, kc idemkafka.ClientConfig, topic string, n int) {
	b.Helper()
	sc := idemkafka.SaramaProducerConfig(kc.Sarama)
	sc.Producer.Return.Successes = true
	prod, err := sarama.NewSyncProducer(kc.Brokers, sc)
	if err != nil {
		b.Fatal(err)
	}
	defer prod.Close()
	batch := make([]*sarama.ProducerMessage, 0, 1000)
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"orderId":"o-%d","amount":"12.34"}`, i))
		m.Metadata.Set(publisher.MetadataEventID, publisher.NewEventID().String())
		m.Metadata.Set(wmiddleware.PoisonedTopicKey, "orders")
		m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, []string{"provider timeout", "contract order.confirmed.v1: currency"}[i%2])
		pm, err := kafka.DefaultMarshaler{}.Marshal(topic, m)
		if err != nil {
			b.Fatal(err)
		}
		pm.Key = sarama.StringEncoder(fmt.Sprintf("o-%d", i%97))
		batch = append(batch, pm)
		if len(batch) == cap(batch) || i == n-1 {
			if err := prod.SendMessages(batch); err != nil {
				b.Fatal(err)
			}
			batch = batch[:0]
		}
	}
}
