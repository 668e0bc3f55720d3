package main_test

import (
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// commitAt commits offset for group on one partition, as a group with no
// member may (generation -1): what a consumer's last commit leaves.
func commitAt(t *testing.T, client sarama.Client, group, topic string, partition int32, offset int64) {
	t.Helper()
	coord, err := client.Coordinator(group)
	require.NoError(t, err)
	req := &sarama.OffsetCommitRequest{Version: 2, ConsumerGroup: group, ConsumerGroupGeneration: -1, RetentionTime: -1}
	req.AddBlock(topic, partition, offset, 0, "")
	resp, err := coord.CommitOffset(req)
	require.NoError(t, err)
	require.Equal(t, sarama.ErrNoError, resp.Errors[topic][partition])
}

// A group whose committed Kafka offsets are ahead of its position in
// PostgreSQL (what a failover to an asynchronous standby leaves): groups
// progress shows it and exits 3; --rewind needs --yes, then sets the
// offsets back to PostgreSQL's, and the next look finds nothing ahead.
func TestGroupsProgressRewind(t *testing.T) {
	t.Parallel()
	db := migrated(t, "plain")
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "progress", 2)
	broker.ProduceKeyed(t, topic, "k", 20)
	// Kafka's committed offsets: 15 and 0 (nothing produced to one partition, whichever).
	client, err := sarama.NewClient(broker.Addrs, sarama.NewConfig())
	require.NoError(t, err)
	defer client.Close()
	var keyed int32 = -1
	for p := range int32(2) {
		hw, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		if hw == 20 {
			keyed = p
		}
	}
	require.GreaterOrEqual(t, keyed, int32(0))
	commitAt(t, client, "g", topic, keyed, 15)
	db.Exec(t, "INSERT INTO processed_event_progress (consumer_group, topic, kafka_partition, next_offset) VALUES ('g', $1, $2, 9)", topic, keyed)

	brokers := []string{"--brokers", strings.Join(broker.Addrs, ",")}
	r := ctl(t, db, append([]string{"groups", "progress", "g"}, brokers...)...)
	require.Equal(t, 3, r.Code, "%s", r)
	require.Regexp(t, topic+`\s+\d\s+9\s+15\s+6`, r.Stdout)
	require.Contains(t, r.Stdout, "6 records ahead of PostgreSQL's position")
	fails(t, db, 2, "add --yes", append([]string{"groups", "progress", "g", "--rewind"}, brokers...)...)

	r = ok(t, db, append([]string{"groups", "progress", "g", "--rewind", "--yes"}, brokers...)...)
	require.Contains(t, r.Stdout, "rewound 1 partitions")
	j := decode[struct {
		Ahead      int64 `json:"kafka_ahead"`
		Partitions []struct {
			Kafka int64 `json:"kafka_offset"`
		} `json:"partitions"`
	}](t, ok(t, db, append([]string{"groups", "progress", "g", "--json"}, brokers...)...))
	require.Zero(t, j.Ahead)
	require.Equal(t, int64(9), j.Partitions[0].Kafka)
}
