package main_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/publisher"
)

type poisonListJSON struct {
	Topic    string `json:"topic"`
	DryRun   bool   `json:"dry_run"`
	Scanned  int    `json:"scanned"`
	Matched  int    `json:"matched"`
	Replayed int    `json:"replayed"`
	Skipped  int    `json:"skipped"`
	Messages []struct {
		Partition     int32   `json:"partition"`
		Offset        int64   `json:"offset"`
		PoisonedAt    *string `json:"poisoned_at"`
		UUID          string  `json:"uuid"`
		EventID       string  `json:"event_id"`
		OccurredAt    *string `json:"occurred_at"`
		OriginalTopic string  `json:"original_topic"`
		Reason        string  `json:"reason"`
		Handler       string  `json:"handler"`
		History       []struct {
			Reason     string  `json:"reason"`
			Topic      string  `json:"topic"`
			ReplayedAt *string `json:"replayed_at"`
		} `json:"history"`
		Replayed bool   `json:"replayed"`
		Skipped  string `json:"skipped"`
	} `json:"messages"`
	Error string `json:"error"`
}

func (p poisonListJSON) eventIDs() []string {
	ids := []string{}
	for _, m := range p.Messages {
		ids = append(ids, m.EventID)
	}
	return ids
}

// poisoned is a message as watermill's PoisonQueue publishes it to the
// poison topic: the original one (event_id, partition_key) plus
// reason_poisoned and, unless originalTopic is "", topic_poisoned,
// handler_poisoned and subscriber_poisoned.
func poisoned(originalTopic, reason string, occurred time.Time) *message.Message {
	m := message.NewMessage(uuid.NewString(), []byte(`{"product":"P-1"}`))
	id := v7At(occurred)
	m.Metadata.Set(publisher.MetadataEventID, id.String())
	publisher.WithPartitionKey(m, "acct-"+id.String()[:8])
	m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, reason)
	if originalTopic != "" {
		m.Metadata.Set(wmiddleware.PoisonedTopicKey, originalTopic)
		m.Metadata.Set(wmiddleware.PoisonedHandlerKey, "ledger")
		m.Metadata.Set(wmiddleware.PoisonedSubscriberKey, "kafka")
	}
	return m
}

// readTopic returns every message of topic's partition 0, oldest first.
func readTopic(t *testing.T, brokers []string, topic string) []*message.Message {
	t.Helper()
	client, err := sarama.NewClient(brokers, sarama.NewConfig())
	require.NoError(t, err)
	defer func() { _ = client.Close() }()
	end, err := client.GetOffset(topic, 0, sarama.OffsetNewest)
	require.NoError(t, err)
	var out []*message.Message
	if end == 0 {
		return out
	}
	consumer, err := sarama.NewConsumerFromClient(client)
	require.NoError(t, err)
	defer func() { _ = consumer.Close() }()
	pc, err := consumer.ConsumePartition(topic, 0, sarama.OffsetOldest)
	require.NoError(t, err)
	defer func() { _ = pc.Close() }()
	for int64(len(out)) < end {
		select {
		case rec := <-pc.Messages():
			m, err := kafka.DefaultMarshaler{}.Unmarshal(rec)
			require.NoError(t, err)
			out = append(out, m)
		case <-time.After(30 * time.Second): // a hang guard
			t.Fatalf("read %s: %d of %d records", topic, len(out), end)
		}
	}
	return out
}

func eventIDOf(m *message.Message) string { return m.Metadata.Get(publisher.MetadataEventID) }

// poison list and replay on the real binary against the broker: the
// filters, the dry run publishing nothing, the replay moving the matching
// messages back to their original topic with the poisoning in
// reason_poisoned_history, a message poisoned again showing its history, a
// publish failure stopping with exit 1 and how far it got.
func TestPoisonListAndReplay(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	poisonTopic := broker.Topic(t, "orders-poison", 1)
	orders := broker.Topic(t, "orders", 1)
	payments := broker.Topic(t, "payments", 1)
	pubCfg, err := idemkafka.WatermillPublisherConfig(idemkafka.ClientConfig{Brokers: broker.Addrs})
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pubCfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	brokers := strings.Join(broker.Addrs, ",")
	ctl := func(code int, args ...string) result {
		t.Helper()
		r := run(t, nil, append(args, "--brokers", brokers)...)
		require.Equal(t, code, r.Code, "idemctl %s\n%s", strings.Join(args, " "), r)
		return r
	}
	list := func(args ...string) poisonListJSON {
		t.Helper()
		return decode[poisonListJSON](t, ctl(0, append([]string{"poison", "list", "--topic", poisonTopic, "--json"}, args...)...))
	}

	now := time.Now()
	newProduct := poisoned(orders, "permanent: unknown product P-new", now.Add(-50*time.Hour))
	newProduct.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	catalogue := poisoned(orders, "permanent: catalogue unavailable", now.Add(-3*time.Hour))
	payment := poisoned(payments, "permanent: unknown product P-9", now.Add(-2*time.Hour))
	noTopic := poisoned("", "boom\x1b[2J", now.Add(-time.Hour))
	require.NoError(t, pub.Publish(poisonTopic, newProduct, catalogue, payment, noTopic))
	time.Sleep(50 * time.Millisecond) // record timestamps are in milliseconds
	mark := time.Now()
	time.Sleep(50 * time.Millisecond)
	late := poisoned(orders, "permanent: unknown product P-late", now)
	require.NoError(t, pub.Publish(poisonTopic, late))
	all := []string{eventIDOf(newProduct), eventIDOf(catalogue), eventIDOf(payment), eventIDOf(noTopic), eventIDOf(late)}

	// list: a row per message, as read, and the summary.
	r := ctl(0, "poison", "list", "--topic", poisonTopic)
	lines := strings.Split(strings.TrimSpace(r.Stdout), "\n")
	require.Len(t, lines, 1+5+2, r.Stdout)
	require.Regexp(t, `^PARTITION\s+OFFSET\s+POISONED AT\s+EVENT ID\s+ORIGINAL TOPIC\s+REPLAYS\s+REASON$`, lines[0])
	require.Regexp(t, `^0\s+0\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ\s+`+eventIDOf(newProduct)+`\s+`+orders+`\s+0\s+permanent: unknown product P-new$`, lines[1])
	require.Regexp(t, `^0\s+3\s+\S+ \S+\s+`+eventIDOf(noTopic)+`\s+-\s+0\s+boom\\x1b\[2J$`, lines[4], "control characters are escaped")
	require.NotContains(t, r.Stdout, "\x1b")
	require.Equal(t, "5 read from "+poisonTopic+", 5 match, 1 of them cannot be replayed (no topic_poisoned metadata: the original topic is unknown)", lines[7])

	p := list()
	require.Equal(t, poisonTopic, p.Topic)
	require.Equal(t, all, p.eventIDs())
	require.Equal(t, 5, p.Scanned)
	require.Equal(t, 1, p.Skipped)
	m := p.Messages[0]
	require.Equal(t, newProduct.UUID, m.UUID)
	require.Equal(t, orders, m.OriginalTopic)
	require.Equal(t, "ledger", m.Handler)
	require.NotNil(t, m.PoisonedAt)
	require.NotNil(t, m.OccurredAt)
	occurred, err := time.Parse(time.RFC3339Nano, *m.OccurredAt)
	require.NoError(t, err)
	require.WithinDuration(t, now.Add(-50*time.Hour), occurred, time.Millisecond, "the UUIDv7 time")
	require.Empty(t, m.History)
	require.False(t, m.Replayed)
	require.Empty(t, m.Skipped)
	require.Contains(t, p.Messages[3].Skipped, "no topic_poisoned metadata")

	// The filters.
	at := mark.UTC().Format(time.RFC3339Nano)
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"--reason", "unknown product"}, []string{all[0], all[2], all[4]}},
		{[]string{"--reason", "permanent: unknown product P-new", "--reason-exact"}, all[:1]},
		{[]string{"--reason", "unknown product", "--reason-exact"}, []string{}},
		{[]string{"--original-topic", orders}, []string{all[0], all[1], all[4]}},
		{[]string{"--reason", "unknown product", "--original-topic", orders}, []string{all[0], all[4]}},
		{[]string{"--event-id", all[1] + "," + all[2]}, all[1:3]},
		{[]string{"--event-id", all[1], "--event-id", all[4]}, []string{all[1], all[4]}},
		{[]string{"--since", at}, all[4:]},
		{[]string{"--until", at}, all[:4]},
		{[]string{"--since", "1h"}, all},
		{[]string{"--occurred-until", "2d"}, all[:1]},
		{[]string{"--occurred-since", "2d", "--original-topic", orders}, []string{all[1], all[4]}},
		{[]string{"--limit", "2"}, all[:2]},
	} {
		require.Equal(t, c.want, list(c.args...).eventIDs(), "%v", c.args)
	}
	r = ctl(0, "poison", "list", "--topic", poisonTopic, "--limit", "2")
	require.Contains(t, r.Stdout, "2 read from "+poisonTopic+", 2 match; stopped at --limit 2\n")
	r = ctl(0, "poison", "list", "--topic", poisonTopic, "--original-topic", "nosuch")
	require.Equal(t, "5 read from "+poisonTopic+", 0 match\n", r.Stdout, "no table without a match")
	r = ctl(2, "poison", "list", "--topic", "nosuch-"+uuid.NewString()[:8])
	require.Contains(t, r.Stderr, "unknown poison topic")

	// replay --dry-run lists what it would replay and publishes nothing.
	r = ctl(0, "poison", "replay", "--topic", poisonTopic, "--reason", "unknown product", "--dry-run")
	require.Regexp(t, `(?m)^STATUS\s+PARTITION\s+OFFSET\s+`, r.Stdout)
	require.Regexp(t, `(?m)^would replay\s+0\s+0\s+.*`+eventIDOf(newProduct), r.Stdout)
	require.Regexp(t, `(?m)^would replay\s+0\s+2\s+.*`+eventIDOf(payment), r.Stdout)
	require.Contains(t, r.Stdout, "5 read from "+poisonTopic+", 3 match: 3 would be replayed; dry run: nothing was published\n")
	p = decode[poisonListJSON](t, ctl(0, "poison", "replay", "--topic", poisonTopic, "--dry-run", "--json"))
	require.True(t, p.DryRun)
	require.Equal(t, 5, p.Matched)
	require.Zero(t, p.Replayed)
	require.Equal(t, 1, p.Skipped)
	require.Empty(t, readTopic(t, broker.Addrs, orders), "a dry run publishes nothing")
	require.Empty(t, readTopic(t, broker.Addrs, payments), "a dry run publishes nothing")

	// replay moves the matching ones back, with their headers and the
	// poisoning in reason_poisoned_history.
	r = ctl(0, "poison", "replay", "--topic", poisonTopic, "--reason", "unknown product", "--original-topic", orders, "--rate", "0")
	require.Regexp(t, `(?m)^replayed\s+0\s+0\s+.*`+eventIDOf(newProduct)+`\s+`+orders+`\s+0\s+permanent: unknown product P-new$`, r.Stdout)
	require.Regexp(t, `(?m)^replayed\s+0\s+4\s+.*`+eventIDOf(late), r.Stdout)
	require.Contains(t, r.Stdout, "5 read from "+poisonTopic+", 2 match: 2 replayed to their original topics\n")
	require.Contains(t, r.Stdout, "the poison topic keeps its records")
	back := readTopic(t, broker.Addrs, orders)
	require.Len(t, back, 2)
	require.Empty(t, readTopic(t, broker.Addrs, payments))
	for i, orig := range []*message.Message{newProduct, late} {
		got := back[i]
		require.Equal(t, orig.UUID, got.UUID)
		require.Equal(t, string(orig.Payload), string(got.Payload))
		for _, k := range []string{publisher.MetadataEventID, publisher.MetadataPartitionKey, "traceparent"} {
			require.Equal(t, orig.Metadata.Get(k), got.Metadata.Get(k), k)
		}
		for _, k := range []string{wmiddleware.ReasonForPoisonedKey, wmiddleware.PoisonedTopicKey, wmiddleware.PoisonedHandlerKey, wmiddleware.PoisonedSubscriberKey} {
			require.NotContains(t, got.Metadata, k)
		}
		var hist []poison.HistoryEntry
		require.NoError(t, json.Unmarshal([]byte(got.Metadata.Get(poison.MetadataReasonHistory)), &hist))
		require.Len(t, hist, 1)
		require.Equal(t, orig.Metadata.Get(wmiddleware.ReasonForPoisonedKey), hist[0].Reason)
		require.Equal(t, orders, hist[0].Topic)
		require.Equal(t, "ledger", hist[0].Handler)
		require.False(t, hist[0].PoisonedAt.IsZero())
		require.WithinDuration(t, time.Now(), hist[0].ReplayedAt, time.Minute)
	}

	// Everything, in JSON: the message without topic_poisoned is skipped.
	p = decode[poisonListJSON](t, ctl(0, "poison", "replay", "--topic", poisonTopic, "--json", "--rate", "100"))
	require.False(t, p.DryRun)
	require.Equal(t, []int{5, 5, 4, 1}, []int{p.Scanned, p.Matched, p.Replayed, p.Skipped})
	require.True(t, p.Messages[0].Replayed)
	require.False(t, p.Messages[3].Replayed)
	require.Contains(t, p.Messages[3].Skipped, "original topic is unknown")
	require.Len(t, readTopic(t, broker.Addrs, orders), 2+3)
	require.Len(t, readTopic(t, broker.Addrs, payments), 1)

	// A replayed message poisoned again carries its history: REPLAYS 1.
	again := back[0].Copy()
	again.Metadata.Set(wmiddleware.ReasonForPoisonedKey, "permanent: unknown product P-new, again")
	again.Metadata.Set(wmiddleware.PoisonedTopicKey, orders)
	require.NoError(t, pub.Publish(poisonTopic, again))
	r = ctl(0, "poison", "list", "--topic", poisonTopic, "--event-id", eventIDOf(newProduct))
	require.Regexp(t, `(?m)^0\s+0\s+.*`+orders+`\s+0\s+permanent: unknown product P-new$`, r.Stdout)
	require.Regexp(t, `(?m)^0\s+5\s+.*`+orders+`\s+1\s+permanent: unknown product P-new, again$`, r.Stdout)
	p = list("--event-id", eventIDOf(newProduct))
	require.Len(t, p.Messages, 2)
	require.Len(t, p.Messages[1].History, 1)
	require.Equal(t, "permanent: unknown product P-new", p.Messages[1].History[0].Reason)
	require.NotNil(t, p.Messages[1].History[0].ReplayedAt)

	// A publish failure (the original topic is gone; replay never creates a
	// topic) stops the replay: exit 1, and how far it got.
	gone := "gone-" + uuid.NewString()[:8]
	lost := poisoned(gone, "permanent: boom", now)
	require.NoError(t, pub.Publish(poisonTopic, lost))
	r = ctl(1, "poison", "replay", "--topic", poisonTopic, "--since", at, "--json")
	p = decode[poisonListJSON](t, r)
	require.Equal(t, []int{7, 3, 2}, []int{p.Scanned, p.Matched, p.Replayed}, "late and again replayed, then the failure")
	require.Len(t, p.Messages, 3)
	require.Equal(t, []bool{true, true, false}, []bool{p.Messages[0].Replayed, p.Messages[1].Replayed, p.Messages[2].Replayed})
	require.Contains(t, p.Error, "publish replayed message")
	require.Contains(t, r.Stderr, "stopped after replaying 2 of the 3 matching messages")
	r = ctl(1, "poison", "replay", "--topic", poisonTopic, "--event-id", eventIDOf(lost))
	require.Equal(t, "7 read from "+poisonTopic+", 1 matches: 0 replayed to their original topics (at most 50/s)\n", r.Stdout, "the summary, without rows")
	require.Contains(t, r.Stderr, "stopped after replaying 0 of the 1 matching messages")
	require.Contains(t, r.Stderr, gone)
	client, err := sarama.NewClient(broker.Addrs, sarama.NewConfig())
	require.NoError(t, err)
	defer func() { _ = client.Close() }()
	topics, err := client.Topics()
	require.NoError(t, err)
	require.NotContains(t, topics, gone, "replay does not create topics")

	// Unreachable brokers: exit 1, nothing read, and with --json the error
	// is the document.
	r = run(t, nil, "poison", "list", "--topic", poisonTopic, "--brokers", "127.0.0.1:1", "--json")
	require.Equal(t, 1, r.Code, r)
	require.Empty(t, r.Stderr)
	e := decode[errorJSON](t, r)
	require.Equal(t, 1, e.Code)
	require.Contains(t, e.Error, "poison: connect")
}
