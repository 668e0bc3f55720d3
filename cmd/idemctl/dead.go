package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// outboxDead is "outbox dead list|retry|drop": the rows the forwarder moved
// to the topics' dead tables, read and moved with the forwarder's own
// statements (outboxsql).
func outboxDead(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	limit := fs.Int("limit", 100, "list at most `N` rows per topic (0: all)")
	key := fs.String("key", "", "retry: the partition `key` whose rows go back to the outbox")
	id := fs.Int64("id", 0, "drop: the dead row `ID` to delete")
	yes := fs.Bool("yes", false, "retry, drop: really do it")
	pos, err := a.parse(fs, args, "list|retry|drop")
	if err != nil {
		return err
	}
	ob, topics, err := a.outboxTopics(ctx)
	if err != nil {
		return err
	}
	switch pos[0] {
	case "list":
		return deadList(ctx, a, ob, topics, *limit)
	case "retry", "drop":
		if len(topics) != 1 {
			return usageError("outbox dead %s acts on one topic: pass --topics T", pos[0])
		}
		topic := topics[0]
		if !*yes {
			return usageError("outbox dead %s changes the outbox: pass --yes to do it (outbox dead list shows the rows)", pos[0])
		}
		if pos[0] == "retry" {
			if !flagSet(fs, "key") {
				return usageError("outbox dead retry needs --key K (--key '' for the rows without a partition key)")
			}
			n, err := deadTables(ob, topic).RetryDeadTx(ctx, a.pool, *key)
			if err != nil {
				return fmt.Errorf("outbox: retry dead rows of %s key %q: %w", topic, *key, err)
			}
			if a.opts.json {
				return a.printJSON(struct {
					Topic   string `json:"topic"`
					Key     string `json:"key"`
					Retried int64  `json:"retried"`
				}{topic, *key, n})
			}
			fmt.Fprintf(a.stdout, "%d rows of key %q moved back to the outbox of %s, in their order; a row that still cannot be sent comes back with the rest of its key\n", n, *key, topic)
			return nil
		}
		if *id <= 0 {
			return usageError("outbox dead drop needs --id N (outbox dead list shows the ids)")
		}
		ok, err := deadTables(ob, topic).DropDead(ctx, a.pool, *id)
		if err != nil {
			return fmt.Errorf("outbox: drop dead row %d of %s: %w", *id, topic, err)
		}
		if !ok {
			return &exitError{code: exitFailure, err: fmt.Errorf("topic %s has no dead row %d", topic, *id)}
		}
		if a.opts.json {
			return a.printJSON(struct {
				Topic   string `json:"topic"`
				ID      int64  `json:"id"`
				Dropped bool   `json:"dropped"`
			}{topic, *id, true})
		}
		fmt.Fprintf(a.stdout, "dead row %d of %s deleted: its message will never be sent; rows held behind it stay until their key is retried\n", *id, topic)
		return nil
	}
	return usageError("usage: %s list|retry|drop", a.path)
}

func deadList(ctx context.Context, a *app, ob *outbox.Outbox, topics []string, limit int) error {
	type rowJSON struct {
		Topic         string    `json:"topic"`
		ID            int64     `json:"id"`
		Offset        int64     `json:"offset"`
		UUID          string    `json:"uuid"`
		Key           string    `json:"key"`
		Size          int       `json:"size"`
		HeldBehind    int64     `json:"held_behind"`
		Cause         string    `json:"cause"`
		QuarantinedAt time.Time `json:"quarantined_at"`
	}
	out := struct {
		Rows []rowJSON `json:"rows"`
	}{Rows: []rowJSON{}}
	for _, topic := range topics {
		rows, err := deadTables(ob, topic).DeadRows(ctx, a.pool, nil, limit)
		if err != nil {
			return fmt.Errorf("outbox: dead rows of %s: %w", topic, err)
		}
		for _, r := range rows {
			out.Rows = append(out.Rows, rowJSON{topic, r.ID, r.Offset, r.UUID, r.Key, r.Size, r.HeldBehind, r.Cause, r.QuarantinedAt})
		}
	}
	if a.opts.json {
		return a.printJSON(out)
	}
	tw := a.table()
	row(tw, "TOPIC", "ID", "OFFSET", "KEY", "SIZE", "HELD BEHIND", "SINCE", "CAUSE")
	for _, r := range out.Rows {
		held := "-"
		if r.HeldBehind > 0 {
			held = strconv.FormatInt(r.HeldBehind, 10)
		}
		row(tw, r.Topic, r.ID, r.Offset, strconv.Quote(r.Key), r.Size, held, r.QuarantinedAt.UTC().Format(time.RFC3339), r.Cause)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "%d dead rows; fix the cause, then: outbox dead retry --topics T --key K --yes (or drop the poison row with outbox dead drop --topics T --id N --yes, then retry its key)\n", len(out.Rows))
	return nil
}

// deadTables returns topic's tables in ob (the topics come from ob's
// Config, which outbox.New validated).
func deadTables(ob *outbox.Outbox, topic string) outboxsql.Tables {
	return outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, topic)
}

// flagSet reports whether the flag name was given on the command line.
func flagSet(fs interface{ Visit(func(*flag.Flag)) }, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}
