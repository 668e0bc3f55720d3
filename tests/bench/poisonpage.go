package bench

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func init() { Register("console-poison-page", poisonPage) }

// poisonPage times what the console's failures explorer does when it opens
// a large poison topic: one page (50 records) read by offset ranges, at the
// start and in the middle, against reading the topic whole as poison.List
// (and `idemctl poison list`) does. The three are rotated round by round.
func poisonPage(ctx context.Context, o Options) (Section, error) {
	records, rounds := 100_000, max(o.Rounds, 3)
	if o.Short {
		records, rounds = 10_000, 2
	}
	const partitions = 4
	brokers := o.Brokers
	if len(brokers) == 0 {
		c, err := kafkatest.NewFake()
		if err != nil {
			return Section{}, err
		}
		defer c.Close()
		brokers = c.ListenAddrs()
	}
	kc := idemkafka.ClientConfig{Brokers: brokers}
	topic := "orders-poison-" + uuid.NewString()[:8]
	if err := kafkatest.CreateTopic(brokers, topic, partitions); err != nil {
		return Section{}, err
	}
	o.Logf("console-poison-page: producing %d records", records)
	if err := producePoison(kc, topic, records); err != nil {
		return Section{}, err
	}
	first, err := poison.ReadPage(ctx, poison.PageConfig{Kafka: kc, Topic: topic})
	if err != nil {
		return Section{}, err
	}
	if first.Depth != int64(records) || len(first.Records) != 50 {
		return Section{}, fmt.Errorf("console-poison-page: depth %d, %d records on the first page", first.Depth, len(first.Records))
	}
	middle := map[int32]int64{}
	for p, oldest := range first.Oldest {
		middle[p] = (oldest + first.Newest[p]) / 2
	}
	page := func(from map[int32]int64) func() (float64, error) {
		return func() (float64, error) {
			began := time.Now()
			p, err := poison.ReadPage(ctx, poison.PageConfig{Kafka: kc, Topic: topic, From: from})
			if err == nil && len(p.Records) != 50 {
				err = fmt.Errorf("console-poison-page: %d records on a page", len(p.Records))
			}
			return 1 / time.Since(began).Seconds(), err
		}
	}
	whole := func() (float64, error) {
		began := time.Now()
		res, err := poison.List(ctx, poison.Config{Kafka: kc, Topic: topic}, nil)
		if err == nil && res.Scanned != records {
			err = fmt.Errorf("console-poison-page: %d scanned", res.Scanned)
		}
		return 1 / time.Since(began).Seconds(), err
	}
	rates, err := Rotate(rounds, whole, page(nil), page(middle))
	if err != nil {
		return Section{}, err
	}
	ms := func(rs []float64) string {
		s := Summarise(rs)
		return fmt.Sprintf("%.0f (%.0f–%.0f)", 1000/s.Median, 1000/s.Max, 1000/s.Min)
	}
	rows := [][]string{
		{"the whole topic, as `poison list` reads it", ms(rates[0]), "1"},
		{"first page (50 records)", ms(rates[1]), Summarise(Ratios(rates[0], rates[1])).String()},
		{"a page from the middle", ms(rates[2]), Summarise(Ratios(rates[0], rates[2])).String()},
	}
	var b strings.Builder
	b.WriteString(Table([]string{fmt.Sprintf("read of a %d-record, %d-partition poison topic", records, partitions), "ms per read, median (min–max)", "speed vs the whole topic"}, rows))
	fmt.Fprintf(&b, "\nWhat `idemctl serve`'s failures explorer does when it opens a poison topic (`poison.ReadPage`: a bounded "+
		"offset range per partition, all partitions at once, never the topic whole) against `poison.List`, which reads every "+
		"record. Each read opens its own Kafka client, as a page request does. The three rotated round by round; %d rounds.\n", rounds)
	return Section{Title: "Console: opening a large poison topic", Markdown: b.String()}, nil
}

// producePoison writes n poison records to topic in batches of 1,000,
// keyed over its partitions, with two reasons.
func producePoison(kc idemkafka.ClientConfig, topic string, n int) error {
	sc := idemkafka.SaramaProducerConfig(kc.Sarama)
	sc.Producer.Return.Successes = true
	prod, err := sarama.NewSyncProducer(kc.Brokers, sc)
	if err != nil {
		return err
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
			return err
		}
		pm.Key = sarama.StringEncoder(fmt.Sprintf("o-%d", i%97))
		batch = append(batch, pm)
		if len(batch) == cap(batch) || i == n-1 {
			if err := prod.SendMessages(batch); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	return nil
}
