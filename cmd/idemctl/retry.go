package main

import (
	"context"
	"flag"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// parkedTableFlag adds --parked-table to fs; the returned function gives
// the table (schema from --schema) after parsing.
func (a *app) parkedTableFlag(fs *flag.FlagSet) func() (retrytopic.ParkedKeysTable, error) {
	name := fs.String("parked-table", parkedTableDefault, "the parked-keys `table` of retrytopic.KeyOrder (in --schema)")
	return func() (retrytopic.ParkedKeysTable, error) {
		t := retrytopic.ParkedKeysTable{Schema: a.opts.schema, Table: *name}
		if _, err := migrate.New(nil, retrytopic.MigrationLine(t)); err != nil {
			return t, usageError("--schema/--parked-table: %v", err)
		}
		return t, nil
	}
}

func retryParked(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	group := fs.String("group", "", "only this dedup consumer `group` (default: every group)")
	limit := fs.Int("limit", 50, "list at most `N` keys, the longest queues first (0: all)")
	table := a.parkedTableFlag(fs)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	t, err := table()
	if err != nil {
		return err
	}
	if *limit < 0 {
		return usageError("usage: --limit must not be negative")
	}
	pool, err := a.connect(ctx)
	if err != nil {
		return err
	}
	sum, keys, err := ops.ReadParked(ctx, pool, t, *group, *limit)
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(ops.ToParked(sum, keys))
	}
	if len(sum) == 0 {
		fmt.Fprintln(a.stdout, "no parked key")
		return nil
	}
	tw := a.table()
	row(tw, "GROUP", "KEYS", "EVENTS", "LONGEST QUEUE", "OLDEST AGE", "MOST OVERDUE COPY")
	for _, s := range sum {
		row(tw, s.ConsumerGroup, s.Keys, s.Events, s.MaxQueue, ops.HumanDuration(s.OldestAge), ops.HumanDuration(s.MaxHeadOverdue))
	}
	row(tw)
	row(tw, "GROUP", "KEY", "QUEUE", "FIRST EVENT", "ITS COPY ON", "OVERDUE", "OLDEST AGE")
	for _, k := range keys {
		topic := k.HeadTopic
		if topic == "" {
			topic = "- (none: unblock it)"
		}
		row(tw, k.ConsumerGroup, k.Key, k.Events, k.Head, topic, ops.HumanDuration(k.HeadOverdue), ops.HumanDuration(k.OldestAge))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(a.stdout, "(a first event whose copy is long overdue is not coming back: idemctl retry unblock)")
	return nil
}

func retryUnblock(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	group := fs.String("group", "", "the dedup consumer `group` (required)")
	key := fs.String("key", "", "the parked `key` (this or --overdue)")
	overdue := fs.Duration("overdue", 0, "every key of the group whose first event's copy is overdue by more than `D` (a stalled retry path), instead of --key")
	skip := fs.Bool("skip", false, "remove the key's first event instead of sending it again (it is then neither applied nor poisoned: replay it)")
	topic := fs.String("topic", "", "the retry `topic` to send to, with an outbox table (default: the topic of the first event's lost copy)")
	yes := fs.Bool("yes", false, "really do it")
	table := a.parkedTableFlag(fs)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	t, err := table()
	if err != nil {
		return err
	}
	switch {
	case *group == "" || (*key == "") == (*overdue <= 0):
		return usageError("usage: --group and one of --key or --overdue are required")
	case *overdue > 0 && *skip:
		return usageError("--skip removes events unapplied: name each key with --key")
	case !*yes:
		return usageError("retry unblock writes the key's first event (or, with --skip, its next event) to the outbox of the retry topic; a copy still on its way would then run as a duplicate, which the claim absorbs; pass --yes to do it")
	}
	pool, err := a.connect(ctx)
	if err != nil {
		return err
	}
	cfg, err := a.outboxConfig(ctx, false)
	if err != nil {
		return err
	}
	ob, err := outbox.New(cfg, nil)
	if err != nil {
		return usageError("%v", err)
	}
	if *overdue > 0 {
		return a.unblockOverdue(ctx, pool, ob, t, *group, *overdue, *topic)
	}
	res, err := retrytopic.Unblock(ctx, pool, ob, t, *group, *key, &retrytopic.UnblockOpts{Skip: *skip, Topic: *topic})
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(res)
	}
	a.printUnblocked(res)
	return nil
}

// unblockOverdue sends again the first event of every key of group whose
// copy is overdue by more than after: the recovery of a stalled retry path
// (retrytopic.ErrHeadOverdue), one key after the other.
func (a *app) unblockOverdue(ctx context.Context, pool *pgxpool.Pool, ob *outbox.Outbox, t retrytopic.ParkedKeysTable, group string, after time.Duration, topic string) error {
	keys, err := parkedsql.Keys(ctx, pool, t.Schema, t.Table, group, 0, deduplicator.ValidateGroupName)
	if err != nil {
		return err
	}
	var done []*retrytopic.UnblockResult
	for _, k := range keys {
		if k.HeadTopic == "" || k.HeadOverdue <= after {
			continue
		}
		res, err := retrytopic.Unblock(ctx, pool, ob, t, group, k.Key, &retrytopic.UnblockOpts{Topic: topic})
		if err != nil {
			return fmt.Errorf("key %q (%d unblocked before it): %w", k.Key, len(done), err)
		}
		done = append(done, res)
		if !a.opts.json {
			a.printUnblocked(res)
		}
	}
	if a.opts.json {
		return a.printJSON(map[string]any{"unblocked": done})
	}
	fmt.Fprintf(a.stdout, "%d keys unblocked (first event's copy overdue by more than %s)\n", len(done), after)
	return nil
}

func (a *app) printUnblocked(res *retrytopic.UnblockResult) {
	fmt.Fprintln(a.stdout, ops.Unblocked(res))
}
