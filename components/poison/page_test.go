package poison_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// poisonRecords publishes n poison records to topic, keyed over its
// partitions: every third one's reason is "timeout", the others "bad
// payload"; all come from orders.
func poisonRecords(t *testing.T, pub message.Publisher, topic string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range n {
		ids[i] = publisher.NewEventID().String()
		m := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"eventId":%q,"n":%d}`, ids[i], i))
		m.Metadata.Set(publisher.MetadataEventID, ids[i])
		m.Metadata.Set(publisher.MetadataPartitionKey, fmt.Sprintf("k%d", i%7))
		m.Metadata.Set(wmiddleware.PoisonedTopicKey, "orders")
		reason := "bad payload"
		if i%3 == 0 {
			reason = "timeout"
		}
		m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, reason)
		msgs[i] = m
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	return ids
}

func newPublisher(t *testing.T, kc idemkafka.ClientConfig) message.Publisher {
	t.Helper()
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

type loc struct {
	p int32
	o int64
}

// readAll pages through topic with cfg until End, and returns every record
// seen, failing on one seen twice.
func readAll(t *testing.T, cfg poison.PageConfig) (map[loc]poison.Record, int) {
	t.Helper()
	seen := map[loc]poison.Record{}
	pages := 0
	for {
		page, err := poison.ReadPage(context.Background(), cfg)
		require.NoError(t, err)
		pages++
		require.LessOrEqual(t, len(page.Records), cfg.Size)
		for i, r := range page.Records {
			l := loc{r.Partition, r.Offset}
			require.NotContains(t, seen, l, "a record on two pages")
			seen[l] = r
			if i > 0 {
				require.False(t, r.PoisonedAt.Before(page.Records[i-1].PoisonedAt), "in the order they were poisoned")
			}
		}
		if page.End {
			return seen, pages
		}
		require.Less(t, pages, 1000)
		cfg.From = page.Next
	}
}

// Paging through a poison topic by offset returns every record once, in
// pages of at most Size; a filter narrower than the scan limit gives short
// pages but still every matching record once; Get reads one record with its
// headers and payload.
func TestReadPage(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	kc := idemkafka.ClientConfig{Brokers: broker.Addrs}
	topic := broker.Topic(t, "orders-poison", 3)
	ids := poisonRecords(t, newPublisher(t, kc), topic, 120)

	first, err := poison.ReadPage(context.Background(), poison.PageConfig{Kafka: kc, Topic: topic, Size: 25})
	require.NoError(t, err)
	require.Len(t, first.Records, 25)
	require.EqualValues(t, 120, first.Depth)
	require.Len(t, first.Oldest, 3)
	require.Len(t, first.Newest, 3)
	require.False(t, first.End)

	all, pages := readAll(t, poison.PageConfig{Kafka: kc, Topic: topic, Size: 25})
	require.Len(t, all, 120)
	require.Equal(t, 5, pages)
	got := map[string]bool{}
	for _, r := range all {
		got[r.EventID] = true
		require.Equal(t, "orders", r.OriginalTopic)
	}
	for _, id := range ids {
		require.True(t, got[id], id)
	}

	timeouts, pages := readAll(t, poison.PageConfig{Kafka: kc, Topic: topic, Size: 25, ScanLimit: 10,
		Filter: poison.Filter{Reason: "timeout", ReasonExact: true}})
	require.Len(t, timeouts, 40)
	require.Greater(t, pages, 3, "bounded scans: more pages than the matches need")
	for _, r := range timeouts {
		require.Equal(t, "timeout", r.Reason)
	}

	var any poison.Record
	for _, r := range all {
		any = r
		break
	}
	rec := get(t, kc, topic, any.Partition, any.Offset)
	require.Equal(t, any.EventID, rec.EventID)
	require.Equal(t, any.EventID, rec.Metadata.Get(publisher.MetadataEventID))
	require.Contains(t, string(rec.Payload), any.EventID)
	past, err := poison.ReadPage(context.Background(), poison.PageConfig{Kafka: kc, Topic: topic,
		From: map[int32]int64{any.Partition: 10_000}, Partitions: []int32{any.Partition}})
	require.NoError(t, err)
	require.Empty(t, past.Records, "past the end: nothing")
}

// Republish sends a record back to its original topic without the poison
// keys, with its history, keeping its event id; an edited payload replaces
// the payload only.
func TestRepublish(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	kc := idemkafka.ClientConfig{Brokers: broker.Addrs}
	topic := broker.Topic(t, "orders-poison", 1)
	orders := broker.Topic(t, "orders", 1)
	pub := newPublisher(t, kc)
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"n":1}`))
	id := publisher.NewEventID().String()
	m.Metadata.Set(publisher.MetadataEventID, id)
	m.Metadata.Set(wmiddleware.PoisonedTopicKey, orders)
	m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, "bad payload")
	require.NoError(t, pub.Publish(topic, m))

	rec := get(t, kc, topic, 0, 0)
	require.NoError(t, rec.Republish(pub, nil, time.Now()))
	require.NoError(t, rec.Republish(pub, []byte(`{"n":2}`), time.Now()))

	page, err := poison.ReadPage(context.Background(), poison.PageConfig{Kafka: kc, Topic: orders})
	require.NoError(t, err)
	require.Len(t, page.Records, 2)
	for i, want := range []string{`{"n":1}`, `{"n":2}`} {
		r := page.Records[i]
		require.Equal(t, want, string(r.Payload))
		require.Equal(t, id, r.Metadata.Get(publisher.MetadataEventID))
		require.Equal(t, m.UUID, r.UUID)
		require.Empty(t, r.Metadata.Get(wmiddleware.ReasonForPoisonedKey))
		require.Len(t, r.History, 1)
		require.Equal(t, "bad payload", r.History[0].Reason)
	}
}

// get reads the record at partition and offset: one partition, from it.
func get(t *testing.T, kc idemkafka.ClientConfig, topic string, partition int32, offset int64) poison.Record {
	t.Helper()
	p, err := poison.ReadPage(context.Background(), poison.PageConfig{Kafka: kc, Topic: topic,
		From: map[int32]int64{partition: offset}, Partitions: []int32{partition}, Size: 1, ScanLimit: 1})
	require.NoError(t, err)
	require.Len(t, p.Records, 1)
	require.Equal(t, offset, p.Records[0].Offset)
	require.Equal(t, map[int32]int64{partition: offset + 1}, p.Next, "only that partition read")
	return p.Records[0]
}
