package main

import (
	"context"
	"fmt"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/internal/progresskafka"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
)

// groupsProgress shows a group's position in PostgreSQL beside its
// committed Kafka offsets and, with --rewind, moves the offsets that are
// ahead back to PostgreSQL's (the recovery of watermill-kafka's subscriber
// after a failover or a restore; docs/operations.md).
func groupsProgress(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	kafkaGroup := fs.String("kafka-group", "", "the Kafka consumer `group` (default: GROUP)")
	topic := fs.String("topic", "", "only this `topic`")
	rewind := fs.Bool("rewind", false, "set the committed offsets that are ahead back to PostgreSQL's position (the group's consumers must be stopped)")
	yes := fs.Bool("yes", false, "confirm --rewind")
	pos, err := a.parse(fs, args, "GROUP")
	if err != nil {
		return err
	}
	if *rewind && !*yes {
		return usageError("--rewind changes the group's committed Kafka offsets: add --yes")
	}
	if *kafkaGroup == "" {
		*kafkaGroup = pos[0]
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	kc, err := a.kafkaConfig()
	if err != nil {
		return err
	}
	client, err := sarama.NewClient(kc.Brokers, kc.Sarama)
	if err != nil {
		return fmt.Errorf("connect to Kafka: %w", err)
	}
	defer client.Close()
	rows, err := progresskafka.Compare(ctx, a.pool, progresssql.Table(tc.Schema, tc.Table), pos[0], client, *kafkaGroup, *topic)
	if err != nil {
		return err
	}
	var moved []progresskafka.Row
	if *rewind {
		if moved, err = progresskafka.Rewind(client, *kafkaGroup, rows); err != nil {
			return err
		}
	}
	return a.printProgress(pos[0], rows, moved, *rewind)
}

func (a *app) printProgress(group string, rows, moved []progresskafka.Row, rewound bool) error {
	var ahead int64
	for _, r := range rows {
		ahead += r.Ahead()
	}
	if a.opts.json {
		type part struct {
			Topic     string `json:"topic"`
			Partition int32  `json:"partition"`
			Postgres  int64  `json:"postgres_offset"`
			Kafka     int64  `json:"kafka_offset"`
			Ahead     int64  `json:"kafka_ahead"`
		}
		out := struct {
			Group      string `json:"group"`
			Partitions []part `json:"partitions"`
			Ahead      int64  `json:"kafka_ahead"`
			Rewound    int    `json:"rewound"`
		}{Group: group, Partitions: []part{}, Ahead: ahead, Rewound: len(moved)}
		for _, r := range rows {
			out.Partitions = append(out.Partitions, part{r.Topic, r.Partition, r.Postgres, r.Kafka, r.Ahead()})
		}
		return a.printJSON(out)
	}
	if len(rows) == 0 {
		fmt.Fprintf(a.stdout, "no position of group %q in PostgreSQL (SkipProgress, lease mode without the subscriber keeping it, or nothing processed yet)\n", group)
		return nil
	}
	tw := a.table()
	row(tw, "TOPIC", "PARTITION", "POSTGRES", "KAFKA", "KAFKA AHEAD")
	for _, r := range rows {
		row(tw, r.Topic, r.Partition, r.Postgres, r.Kafka, r.Ahead())
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	switch {
	case rewound:
		fmt.Fprintf(a.stdout, "rewound %d partitions to PostgreSQL's position: their consumers process the %d records between again (claims skip those applied)\n", len(moved), ahead)
	case ahead > 0:
		fmt.Fprintf(a.stdout, "Kafka's committed offsets are %d records ahead of PostgreSQL's position: records this database may never have applied "+
			"(a failover to an asynchronous standby, a restore). Stop the group's consumers, then run with --rewind --yes\n", ahead)
		return &exitError{code: exitNo}
	}
	return nil
}
