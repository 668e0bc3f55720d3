package ops

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/progresskafka"
)

// KafkaView reads the depth of the poison and retry topics and the lag of
// the consumer groups reading them, for the overview of idemctl serve
// --brokers. It keeps one client for the life of the server.
type KafkaView struct {
	mu     sync.Mutex
	client sarama.Client
	admin  sarama.ClusterAdmin
	topics []string // --kafka-topics; none: every topic whose name has "poison" or "retry"
	groups []string // --kafka-groups; none: every group with a committed offset on them
}

// kafkaJSON is the overview's kafka part.
type kafkaJSON struct {
	Topics []kafkaTopicJSON `json:"topics"`
	Lag    []kafkaLagJSON   `json:"lag"`
}

type kafkaTopicJSON struct {
	Topic string `json:"topic"`
	// Depth is the records the topic holds: the sum over its partitions of
	// the newest offset less the oldest.
	Depth      int64                `json:"depth"`
	Partitions []kafkaPartitionJSON `json:"partitions"`
}

type kafkaPartitionJSON struct {
	Partition int32 `json:"partition"`
	Oldest    int64 `json:"oldest"`
	Newest    int64 `json:"newest"`
}

// kafkaLagJSON is one group's lag on one partition: the newest offset less
// its committed one.
type kafkaLagJSON struct {
	Group     string `json:"group"`
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	Committed int64  `json:"committed"`
	Lag       int64  `json:"lag"`
}

// NewKafkaView connects to brokers with cfg; topics and groups narrow what
// it reads (none: every topic whose name has poison or retry, every group
// with a committed offset on them). Close it.
func NewKafkaView(brokers []string, cfg *sarama.Config, topics, groups []string) (*KafkaView, error) {
	client, err := sarama.NewClient(brokers, cfg)
	if err != nil {
		return nil, fmt.Errorf("kafka: %w", err)
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		_ = client.Close()
		return nil, fmt.Errorf("kafka: %w", err)
	}
	return &KafkaView{client: client, admin: admin, topics: topics, groups: groups}, nil
}

// progress compares group's position in PostgreSQL (progressTable) with
// the committed offsets of the Kafka consumer group of the same name.
func (k *KafkaView) progress(ctx context.Context, db dbx.Querier, progressTable, group string) ([]progresskafka.Row, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return progresskafka.Compare(ctx, db, progressTable, group, k.client, group, "")
}

// Close closes the view's client.
func (k *KafkaView) Close() { _ = k.admin.Close() } // closes the client too

func (k *KafkaView) read() (*kafkaJSON, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if err := k.client.RefreshMetadata(); err != nil {
		return nil, fmt.Errorf("kafka metadata: %w", err)
	}
	topics := k.topics
	if len(topics) == 0 {
		all, err := k.client.Topics()
		if err != nil {
			return nil, fmt.Errorf("kafka topics: %w", err)
		}
		for _, t := range all {
			if strings.Contains(t, "poison") || strings.Contains(t, "retry") {
				topics = append(topics, t)
			}
		}
		slices.Sort(topics)
	}
	out := &kafkaJSON{Topics: []kafkaTopicJSON{}, Lag: []kafkaLagJSON{}}
	newest := map[string]map[int32]int64{}
	parts := map[string][]int32{}
	for _, topic := range topics {
		ps, err := k.client.Partitions(topic)
		if err != nil {
			return nil, fmt.Errorf("kafka topic %s: %w", topic, err)
		}
		t := kafkaTopicJSON{Topic: topic, Partitions: []kafkaPartitionJSON{}}
		newest[topic] = map[int32]int64{}
		parts[topic] = ps
		for _, p := range ps {
			hi, err := k.client.GetOffset(topic, p, sarama.OffsetNewest)
			if err != nil {
				return nil, fmt.Errorf("kafka %s/%d: %w", topic, p, err)
			}
			lo, err := k.client.GetOffset(topic, p, sarama.OffsetOldest)
			if err != nil {
				return nil, fmt.Errorf("kafka %s/%d: %w", topic, p, err)
			}
			t.Partitions = append(t.Partitions, kafkaPartitionJSON{p, lo, hi})
			t.Depth += hi - lo
			newest[topic][p] = hi
		}
		out.Topics = append(out.Topics, t)
	}
	groups := k.groups
	if len(groups) == 0 {
		all, err := k.admin.ListConsumerGroups()
		if err != nil {
			return nil, fmt.Errorf("kafka consumer groups: %w", err)
		}
		for g := range all {
			groups = append(groups, g)
		}
		slices.Sort(groups)
	}
	for _, g := range groups {
		res, err := k.admin.ListConsumerGroupOffsets(g, parts)
		if err != nil {
			return nil, fmt.Errorf("kafka offsets of group %s: %w", g, err)
		}
		for _, topic := range topics {
			for _, p := range parts[topic] {
				b := res.GetBlock(topic, p)
				if b == nil || b.Offset < 0 {
					continue // no committed offset: the group does not read it
				}
				out.Lag = append(out.Lag, kafkaLagJSON{g, topic, p, b.Offset, newest[topic][p] - b.Offset})
			}
		}
	}
	return out, nil
}

// PoisonTopics returns the poison topics the failures explorer offers:
// named, else every topic whose name has "poison".
func (k *KafkaView) PoisonTopics(named []string) ([]string, error) {
	if len(named) > 0 {
		return named, nil
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if err := k.client.RefreshMetadata(); err != nil {
		return nil, fmt.Errorf("kafka metadata: %w", err)
	}
	all, err := k.client.Topics()
	if err != nil {
		return nil, fmt.Errorf("kafka topics: %w", err)
	}
	var out []string
	for _, t := range all {
		if strings.Contains(t, "poison") {
			out = append(out, t)
		}
	}
	slices.Sort(out)
	return out, nil
}
