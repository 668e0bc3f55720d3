package main

import (
	"context"
	"fmt"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

func outboxReposition(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	forwarder := fs.String("forwarder", outbox.DefaultForwarderName, "the forwarder `name` (ForwarderConfig.Name) whose position is reset")
	dryRun := fs.Bool("dry-run", false, "list what would be re-sent; change nothing")
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	ob, topics, err := a.outboxTopics(ctx)
	if err != nil {
		return err
	}
	rs, err := reposition(ctx, a.pool, ob, *forwarder, topics, *dryRun)
	if err != nil {
		return err
	}
	problem := func(r repositioned) string {
		if r.Foreign == nil {
			return ""
		}
		fe := r.Foreign
		return (&outbox.PositionError{Topic: r.topic, Forwarder: fe.Name, StoredSystemID: fe.Stored.System, SystemID: fe.Current.System,
			StoredXmax: fe.Stored.Xmax, Xmax: fe.Current.Xmax}).Error()
	}
	if a.opts.json {
		type topic struct {
			Topic       string `json:"topic"`
			Problem     string `json:"problem"`
			Resend      int64  `json:"resend"`
			FirstOffset int64  `json:"first_offset"`
			LastOffset  int64  `json:"last_offset"`
			Restamped   int64  `json:"restamped"`
			Done        bool   `json:"done"`
		}
		out := struct {
			Forwarder string  `json:"forwarder"`
			DryRun    bool    `json:"dry_run"`
			Topics    []topic `json:"topics"`
		}{*forwarder, *dryRun, []topic{}}
		for _, r := range rs {
			out.Topics = append(out.Topics, topic{r.topic, problem(r), r.Resend, r.First, r.Last, r.Restamped, r.Done})
		}
		return a.printJSON(out)
	}
	tw := a.table()
	row(tw, "TOPIC", "POSITION", "RESEND", "OFFSETS", "OTHER CLUSTER'S IDS")
	var total int64
	for _, r := range rs {
		pos := "this cluster's"
		if r.Foreign != nil {
			pos = "another cluster's"
		}
		offsets := "-"
		if r.Resend > 0 {
			offsets = fmt.Sprintf("%d-%d", r.First, r.Last)
		}
		row(tw, r.topic, pos, r.Resend, offsets, r.Restamped)
		total += r.Resend
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rs {
		if r.Foreign != nil {
			fmt.Fprintf(a.stdout, "%s: %s\n", r.topic, problem(r))
		}
	}
	if *dryRun {
		fmt.Fprintf(a.stdout, "dry run, nothing changed: %d rows would be forwarded again by %s (run without --dry-run to reset the positions)\n", total, *forwarder)
		return nil
	}
	fmt.Fprintf(a.stdout, "positions of %s reset: %d rows (every row in the tables) will be forwarded again; nothing was deleted\n", *forwarder, total)
	return nil
}

// repositioned is what reposition did, or would do, in one topic.
type repositioned struct {
	topic string
	outboxsql.Repositioned
}

// reposition resets forwarder's position in each topic to the start of the
// table, each topic in its own transaction, so that every row still in the
// table is forwarded again; with dryRun it only reports.
func reposition(ctx context.Context, db *pgxpool.Pool, ob *outbox.Outbox, forwarder string, topics []string, dryRun bool) ([]repositioned, error) {
	cfg := ob.Config()
	out := make([]repositioned, 0, len(topics))
	for _, topic := range topics {
		r := repositioned{topic: topic}
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) (err error) {
			r.Repositioned, err = outboxsql.TopicTables(cfg.Schema, cfg.TablePrefix, topic).Reposition(ctx, tx, forwarder, dryRun)
			return err
		})
		if err != nil {
			return out, fmt.Errorf("outbox: reposition %s in %s: %w", forwarder, topic, err)
		}
		out = append(out, r)
	}
	return out, nil
}
