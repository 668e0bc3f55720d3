package main

import (
	"context"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"strings"
	"time"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
)

// cleanerFlags are the Cleaner settings both cleanup run and partitions
// maintain take.
type cleanerFlags struct {
	dryRun           *bool
	batchSize        *int
	statementTimeout *time.Duration
	ahead            *int
	deleteNonV7      *bool
}

func addCleanerFlags(fs interface {
	Bool(string, bool, string) *bool
	Int(string, int, string) *int
	Duration(string, time.Duration, string) *time.Duration
}, withNonV7 bool) cleanerFlags {
	f := cleanerFlags{
		dryRun:           fs.Bool("dry-run", false, "report what the pass would delete, move, create and drop (Cleaner.Plan); change nothing"),
		batchSize:        fs.Int("batch-size", 0, "rows deleted per transaction (default 10000)"),
		statementTimeout: fs.Duration("statement-timeout", 0, "bound on each batch (default 10s)"),
		ahead:            fs.Int("ahead", 0, "daily partitions kept ready after today's, partitioned layout (default 3)"),
	}
	if withNonV7 {
		f.deleteNonV7 = fs.Bool("delete-non-v7", false, "also delete rows whose event id is not a UUIDv7, by processed_at (plain layout; for consumers with AllowNonV7)")
	} else {
		f.deleteNonV7 = new(bool)
	}
	return f
}

func (a *app) runCleaner(ctx context.Context, tc deduplicator.TableConfig, f cleanerFlags) error {
	if *f.batchSize < 0 || *f.ahead < 0 || *f.statementTimeout < 0 {
		return usageError("usage: --batch-size, --ahead and --statement-timeout must not be negative")
	}
	c, err := deduplicator.NewCleaner(deduplicator.CleanerConfig{
		TableConfig:      tc,
		DB:               a.pool,
		BatchSize:        *f.batchSize,
		StatementTimeout: *f.statementTimeout,
		PartitionsAhead:  *f.ahead,
		DeleteNonV7:      *f.deleteNonV7,
	}, nil)
	if err != nil {
		return usageError("%v", err)
	}
	pass := c.RunOnce
	if *f.dryRun {
		pass = c.Plan
	}
	res, err := pass(ctx)
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(struct {
			Table             string   `json:"table"`
			Layout            string   `json:"layout"`
			DryRun            bool     `json:"dry_run"`
			Skipped           bool     `json:"skipped"`
			RetentionSeconds  float64  `json:"retention_seconds"`
			Deleted           int64    `json:"deleted"`
			LeasesDeleted     int64    `json:"leases_deleted"`
			Batches           int      `json:"batches"`
			Timeouts          int      `json:"timeouts"`
			RowsMoved         int64    `json:"rows_moved"`
			PartitionsCreated []string `json:"partitions_created"`
			PartitionsDropped []string `json:"partitions_dropped"`
			PartitionsKept    []string `json:"partitions_kept"`
			YoungGroups       []string `json:"young_groups"`
			DurationMS        float64  `json:"duration_ms"`
		}{tc.Schema + "." + tc.Table, tc.Layout.String(), *f.dryRun, res.Skipped, res.Retention.Seconds(), res.Deleted, res.LeasesDeleted, res.Batches, res.Timeouts,
			res.RowsMoved, nonNil(res.PartitionsCreated), nonNil(res.PartitionsDropped), nonNil(res.PartitionsKept), nonNil(res.YoungGroups),
			float64(res.Duration.Microseconds()) / 1000})
	}
	if res.Skipped {
		fmt.Fprintf(a.stdout, "skipped: another instance is cleaning %s.%s (it holds the cleaner's lock); nothing done\n", tc.Schema, tc.Table)
		return nil
	}
	would := ""
	if *f.dryRun {
		fmt.Fprintf(a.stdout, "dry run on %s.%s (%s): nothing was changed\n", tc.Schema, tc.Table, tc.Layout)
		would = "would be "
	} else {
		fmt.Fprintf(a.stdout, "cleaned %s.%s (%s) in %s\n", tc.Schema, tc.Table, tc.Layout, ops.HumanDuration(res.Duration))
	}
	tw := a.table()
	row(tw, "retention applied", ops.HumanDuration(res.Retention))
	row(tw, "rows "+would+"deleted", fmt.Sprintf("%d (batches: %d, timed out: %d)", res.Deleted, res.Batches, res.Timeouts))
	row(tw, "expired leases "+would+"deleted", res.LeasesDeleted)
	if tc.Layout == deduplicator.LayoutPartitioned {
		row(tw, "partitions "+would+"created", countNames(res.PartitionsCreated))
		row(tw, "rows "+would+"moved from DEFAULT", res.RowsMoved)
		row(tw, "partitions "+would+"dropped", countNames(res.PartitionsDropped))
		row(tw, "old partitions kept", countNames(res.PartitionsKept))
	}
	if len(res.YoungGroups) > 0 {
		row(tw, "young groups (claims kept)", strings.Join(res.YoungGroups, ", "))
	}
	return tw.Flush()
}

func countNames(names []string) string {
	if len(names) == 0 {
		return "0"
	}
	return fmt.Sprintf("%d: %s", len(names), strings.Join(names, ", "))
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func cleanupRun(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	f := addCleanerFlags(fs, true)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	return a.runCleaner(ctx, tc, f)
}

func partitionsMaintain(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	f := addCleanerFlags(fs, false)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	if tc.Layout != deduplicator.LayoutPartitioned {
		return usageError("%s.%s is not partitioned (layout %s): it has no partitions to maintain; use idemctl cleanup run", tc.Schema, tc.Table, tc.Layout)
	}
	return a.runCleaner(ctx, tc, f)
}

func partitionsList(ctx context.Context, a *app, args []string) error {
	tc, err := a.tableOnly(ctx, args)
	if err != nil {
		return err
	}
	info, err := dedupsql.Inspect(ctx, a.pool, tc.Schema, tc.Table)
	if err != nil {
		return err
	}
	parts := info.Partitions
	if a.opts.json {
		out := []ops.Partition{}
		for _, p := range parts {
			out = append(out, ops.ToPartition(p))
		}
		return a.printJSON(out)
	}
	if len(parts) == 0 {
		fmt.Fprintf(a.stdout, "%s.%s has no partitions (layout %s)\n", tc.Schema, tc.Table, tc.Layout)
		return nil
	}
	tw := a.table()
	row(tw, "PARTITION", "EVENTS FROM", "TO", "SIZE")
	for _, p := range parts {
		from, to := partitionRange(p)
		row(tw, p.Name, from, to, ops.HumanBytes(p.Bytes))
	}
	return tw.Flush()
}
