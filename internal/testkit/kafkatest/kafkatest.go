// Package kafkatest provides a Kafka-protocol broker for tests: the cluster
// named by KAFKA_BROKERS when set, otherwise an in-process kfake broker on
// 127.0.0.1 that real clients (Sarama via watermill-kafka) reach over TCP.
package kafkatest

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kversion"

	"github.com/idemkit/watermill-idempotency/internal/kfake"
)

// Broker is a Kafka-protocol cluster for one test.
type Broker struct {
	Addrs []string
	// Fake is the in-process cluster, nil when KAFKA_BROKERS is used.
	Fake *kfake.Cluster
}

// External returns the brokers from KAFKA_BROKERS (comma separated), or nil.
func External() []string {
	v := strings.TrimSpace(os.Getenv("KAFKA_BROKERS"))
	if v == "" {
		return nil
	}
	return strings.Split(v, ",")
}

// Start returns a broker that lives until the test ends.
func Start(tb testing.TB) *Broker {
	tb.Helper()
	if os.Getenv("IDEM_UNIT") != "" { // pgtest.UnitEnv; this package does not import pgtest
		tb.Skip("needs a Kafka broker: skipped in make test/unit")
	}
	if addrs := External(); addrs != nil {
		return &Broker{Addrs: addrs}
	}
	c, err := NewFake()
	if err != nil {
		tb.Fatalf("kafkatest: start kfake: %v", err)
	}
	tb.Cleanup(c.Close)
	return &Broker{Addrs: c.ListenAddrs(), Fake: c}
}

// NewFake starts an in-process single-node kfake cluster on a random
// loopback port. The caller closes it.
func NewFake(opts ...kfake.Opt) (*kfake.Cluster, error) {
	base := []kfake.Opt{
		kfake.NumBrokers(1),
		kfake.DefaultNumPartitions(1),
		// Sarama's default session timeout is 10s; kfake's minimum is 6s.
		kfake.GroupMinSessionTimeout(100 * time.Millisecond),
	}
	// KFAKE_LOG=debug (or info, warn, error) logs the broker to standard
	// error: a group that does not settle shows its coordinator's view.
	if lvl, ok := map[string]kfake.LogLevel{"debug": kfake.LogLevelDebug, "info": kfake.LogLevelInfo, "warn": kfake.LogLevelWarn, "error": kfake.LogLevelError}[os.Getenv("KFAKE_LOG")]; ok {
		base = append(base, kfake.WithLogger(kfake.BasicLogger(os.Stderr, lvl)))
	}
	return kfake.NewCluster(append(base, opts...)...)
}

// Topic creates a topic with a unique name and the given partition count and
// returns its name.
func (b *Broker) Topic(tb testing.TB, prefix string, partitions int32) string {
	tb.Helper()
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	name := prefix + "-" + hex.EncodeToString(rnd[:])
	if err := CreateTopic(b.Addrs, name, partitions); err != nil {
		tb.Fatalf("kafkatest: create topic %s: %v", name, err)
	}
	return name
}

// CreateTopic creates topic through the Kafka admin API (works on kfake and
// on a real cluster). An existing topic is not an error.
func CreateTopic(brokers []string, topic string, partitions int32) error {
	cfg := sarama.NewConfig()
	admin, err := sarama.NewClusterAdmin(brokers, cfg)
	if err != nil {
		return err
	}
	defer admin.Close()
	err = admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false)
	if errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return nil
	}
	return err
}

// ProduceKeyed writes n empty records of key to topic, each with a fresh
// Watermill message UUID header, as watermill-kafka's publisher writes a
// message with that partition key.
func (b *Broker) ProduceKeyed(tb testing.TB, topic, key string, n int) {
	tb.Helper()
	cfg := sarama.NewConfig()
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	p, err := sarama.NewSyncProducer(b.Addrs, cfg)
	if err != nil {
		tb.Fatalf("kafkatest: producer: %v", err)
	}
	defer p.Close()
	for range n {
		id := make([]byte, 16)
		_, _ = rand.Read(id)
		_, _, err := p.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(key), Value: sarama.ByteEncoder(nil),
			Headers: []sarama.RecordHeader{{Key: []byte("_watermill_message_uuid"), Value: []byte(hex.EncodeToString(id))}}})
		if err != nil {
			tb.Fatalf("kafkatest: produce to %s: %v", topic, err)
		}
	}
}

// StartOld returns an in-process broker that speaks only the requests of
// versions (kversion.V3_9_0() for a broker without KIP-848, say), so that a
// test can check what a client refuses on an older cluster. It skips the
// test when KAFKA_BROKERS names a real cluster.
func StartOld(tb testing.TB, versions *kversion.Versions) *Broker {
	tb.Helper()
	if External() != nil {
		tb.Skip("needs the in-process broker: KAFKA_BROKERS names a real cluster")
	}
	if os.Getenv("IDEM_UNIT") != "" {
		tb.Skip("needs a Kafka broker: skipped in make test/unit")
	}
	c, err := NewFake(kfake.MaxVersions(versions))
	if err != nil {
		tb.Fatalf("kafkatest: start kfake: %v", err)
	}
	tb.Cleanup(c.Close)
	return &Broker{Addrs: c.ListenAddrs(), Fake: c}
}
