package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"strings"

	"github.com/idemkit/watermill-idempotency/outbox"
)

// outboxTopics returns the Outbox of the flags and its topics, refusing an
// empty list and topics whose tables do not exist (bad input).
func (a *app) outboxTopics(ctx context.Context) (*outbox.Outbox, []string, error) {
	if _, err := a.connect(ctx); err != nil {
		return nil, nil, err
	}
	cfg, err := a.outboxConfig(ctx, true)
	if err != nil {
		return nil, nil, err
	}
	if len(cfg.Topics) == 0 {
		return nil, nil, usageError("no outbox topic: none is recorded under prefix %s in %s.idem_schema_migration; pass --topics (and --outbox-prefix, --outbox-schema)", cfg.TablePrefix, cfg.Schema)
	}
	ob, err := outbox.New(cfg, nil)
	if err != nil {
		return nil, nil, usageError("%v", err)
	}
	for _, topic := range cfg.Topics {
		if err := ob.Check(ctx, a.pool, topic); errors.Is(err, outbox.ErrTopicNotMigrated) {
			return nil, nil, usageError("unknown outbox topic %q: table %s does not exist (check --topics, --outbox-prefix, --outbox-schema)", topic, ob.MessagesTable(topic))
		}
	}
	return ob, cfg.Topics, nil
}

func outboxBacklog(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	forwarder := fs.String("forwarder", outbox.DefaultForwarderName, "the forwarder `name` (ForwarderConfig.Name) whose position counts")
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	ob, topics, err := a.outboxTopics(ctx)
	if err != nil {
		return err
	}
	bl, err := ob.Backlog(ctx, a.pool, &outbox.BacklogOpts{Forwarder: *forwarder, Topics: topics})
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(ops.ToBacklog(*forwarder, bl))
	}
	tw := a.table()
	row(tw, "TOPIC", "PENDING", "OLDEST AGE")
	for _, b := range bl {
		age := "-"
		if b.Pending > 0 {
			age = ops.HumanDuration(b.OldestAge)
		}
		row(tw, b.Topic, b.Pending, age)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "(forwarder %s; rows of transactions still open are not counted)\n", *forwarder)
	return nil
}

func outboxPrune(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	var forwarders stringsFlag
	fs.Var(&forwarders, "forwarders", "`names` of every forwarder and watermill-sql subscriber reading the tables: a row is deleted once all of them passed it (default "+outbox.DefaultForwarderName+")")
	batch := fs.Int("batch-size", 0, "rows per DELETE, each in its own transaction (default 5000)")
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	if *batch < 0 {
		return usageError("usage: --batch-size must not be negative")
	}
	ob, topics, err := a.outboxTopics(ctx)
	if err != nil {
		return err
	}
	type topic struct {
		Topic   string `json:"topic"`
		Deleted int64  `json:"deleted"`
	}
	out := []topic{}
	var total int64
	for _, t := range topics {
		n, err := ob.DeleteForwarded(ctx, a.pool, &outbox.DeleteForwardedOpts{Forwarders: forwarders, Topics: []string{t}, BatchSize: *batch})
		total += n
		out = append(out, topic{t, n})
		if err != nil {
			return fmt.Errorf("after deleting %d rows: %w", total, err)
		}
	}
	if a.opts.json {
		return a.printJSON(struct {
			Forwarders []string `json:"forwarders"`
			Topics     []topic  `json:"topics"`
			Deleted    int64    `json:"deleted"`
		}{nonNil(forwarders), out, total})
	}
	tw := a.table()
	row(tw, "TOPIC", "DELETED")
	for _, t := range out {
		row(tw, t.Topic, t.Deleted)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	names := []string(forwarders)
	if len(names) == 0 {
		names = []string{outbox.DefaultForwarderName}
	}
	fmt.Fprintf(a.stdout, "%d rows deleted: those every one of %s had forwarded\n", total, strings.Join(names, ", "))
	return nil
}
