package main

import (
	"context"
	"fmt"

	"github.com/idemkit/watermill-idempotency/outbox"
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
	rs, err := ob.Reposition(ctx, a.pool, &outbox.RepositionOpts{Forwarder: *forwarder, Topics: topics, DryRun: *dryRun})
	if err != nil {
		return err
	}
	problem := func(r outbox.Reposition) string {
		if r.Problem == nil {
			return ""
		}
		return r.Problem.Error()
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
			out.Topics = append(out.Topics, topic{r.Topic, problem(r), r.Resend, r.First, r.Last, r.Restamped, r.Done})
		}
		return a.printJSON(out)
	}
	tw := a.table()
	row(tw, "TOPIC", "POSITION", "RESEND", "OFFSETS", "OTHER CLUSTER'S IDS")
	var total int64
	for _, r := range rs {
		pos := "this cluster's"
		if r.Problem != nil {
			pos = "another cluster's"
		}
		offsets := "-"
		if r.Resend > 0 {
			offsets = fmt.Sprintf("%d-%d", r.First, r.Last)
		}
		row(tw, r.Topic, pos, r.Resend, offsets, r.Restamped)
		total += r.Resend
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rs {
		if r.Problem != nil {
			fmt.Fprintf(a.stdout, "%s: %s\n", r.Topic, problem(r))
		}
	}
	if *dryRun {
		fmt.Fprintf(a.stdout, "dry run, nothing changed: %d rows would be forwarded again by %s (run without --dry-run to reset the positions)\n", total, *forwarder)
		return nil
	}
	fmt.Fprintf(a.stdout, "positions of %s reset: %d rows (every row in the tables) will be forwarded again; nothing was deleted\n", *forwarder, total)
	return nil
}
