// Package progresskafka compares a consumer group's committed Kafka offsets
// with its position kept in PostgreSQL (internal/progresssql) and rewinds
// the Kafka offsets to PostgreSQL's: the operator's tools for watermill-
// kafka's subscriber, which starts from Kafka's committed offset and
// cannot be told to start elsewhere (idemctl progress).
package progresskafka

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
)

// Row is one partition of a group: PostgreSQL's position and Kafka's
// committed offset (-1 when none).
type Row struct {
	Topic     string
	Partition int32
	Postgres  int64
	Kafka     int64
}

// Ahead is how many offsets Kafka's committed offset is past PostgreSQL's
// position: records that may never have been applied to this database (a
// failover to an asynchronous standby, a restore), or 0.
func (r Row) Ahead() int64 { return max(r.Kafka-r.Postgres, 0) }

// Compare returns the partitions of group with a position in PostgreSQL
// (progressTable; all topics when topic is ""), with kafkaGroup's committed
// offsets.
func Compare(ctx context.Context, db dbx.Querier, progressTable, group string, client sarama.Client, kafkaGroup, topic string) ([]Row, error) {
	pos, _, err := progresssql.Load(ctx, db, progressTable, group, topic)
	if err != nil {
		return nil, err
	}
	want := map[string][]int32{}
	for _, p := range pos {
		want[p.Topic] = append(want[p.Topic], p.Partition)
	}
	committed := map[string]map[int32]int64{}
	if len(want) > 0 {
		admin, err := sarama.NewClusterAdminFromClient(client)
		if err != nil {
			return nil, fmt.Errorf("kafka admin: %w", err)
		}
		resp, err := admin.ListConsumerGroupOffsets(kafkaGroup, want)
		if err != nil {
			return nil, fmt.Errorf("committed offsets of group %q: %w", kafkaGroup, err)
		}
		for t, parts := range resp.Blocks {
			committed[t] = map[int32]int64{}
			for part, b := range parts {
				if b.Err != sarama.ErrNoError {
					return nil, fmt.Errorf("committed offset of %s/%d: %w", t, part, b.Err)
				}
				committed[t][part] = b.Offset
			}
		}
	}
	out := make([]Row, 0, len(pos))
	for _, p := range pos {
		k, ok := committed[p.Topic][p.Partition]
		if !ok {
			k = -1
		}
		out = append(out, Row{Topic: p.Topic, Partition: p.Partition, Postgres: p.Next, Kafka: k})
	}
	return out, nil
}

// ErrGroupActive is returned by Rewind while the Kafka group has members:
// the coordinator takes offsets only from its members then, and they would
// overwrite a rewind with their own commits. Stop the consumers first.
var ErrGroupActive = errors.New("the Kafka consumer group has active members: stop its consumers first")

// Rewind sets kafkaGroup's committed offset of each row that is ahead of
// PostgreSQL back to PostgreSQL's position, and returns the rows it moved.
// The group must have no members (ErrGroupActive). Nothing is lost by a
// rewind: the records between are handed out again and their claims skip
// those already applied.
func Rewind(client sarama.Client, kafkaGroup string, rows []Row) ([]Row, error) {
	var moved []Row
	for _, r := range rows {
		if r.Ahead() > 0 {
			moved = append(moved, r)
		}
	}
	if len(moved) == 0 {
		return nil, nil
	}
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("kafka admin: %w", err)
	}
	groups, err := admin.DescribeConsumerGroups([]string{kafkaGroup})
	if err != nil {
		return nil, fmt.Errorf("describe group %q: %w", kafkaGroup, err)
	}
	for _, g := range groups {
		if len(g.Members) > 0 || (g.State != "" && !slices.Contains([]string{"Empty", "Dead"}, g.State)) {
			return nil, fmt.Errorf("rewind group %q (state %s, %d members): %w", kafkaGroup, g.State, len(g.Members), ErrGroupActive)
		}
	}
	om, err := sarama.NewOffsetManagerFromClient(kafkaGroup, client)
	if err != nil {
		return nil, fmt.Errorf("offset manager: %w", err)
	}
	var poms []sarama.PartitionOffsetManager
	defer func() {
		for _, p := range poms {
			_ = p.Close()
		}
		_ = om.Close()
	}()
	for _, r := range moved {
		pom, err := om.ManagePartition(r.Topic, r.Partition)
		if err != nil {
			return nil, fmt.Errorf("offsets of %s/%d: %w", r.Topic, r.Partition, err)
		}
		poms = append(poms, pom)
		pom.ResetOffset(r.Postgres, "")
	}
	om.Commit()
	// The offset manager reports commit errors only to a log: read back.
	want := map[string][]int32{}
	for _, r := range moved {
		want[r.Topic] = append(want[r.Topic], r.Partition)
	}
	resp, err := admin.ListConsumerGroupOffsets(kafkaGroup, want)
	if err != nil {
		return nil, fmt.Errorf("read back the rewound offsets: %w", err)
	}
	for _, r := range moved {
		if b := resp.GetBlock(r.Topic, r.Partition); b == nil || b.Offset != r.Postgres {
			return nil, fmt.Errorf("rewind %s/%d to %d did not take (a consumer of group %q committed meanwhile?): %w", r.Topic, r.Partition, r.Postgres, kafkaGroup, ErrGroupActive)
		}
	}
	return moved, nil
}
