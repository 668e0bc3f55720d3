package main

import (
	"context"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"time"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
)

func groupsList(ctx context.Context, a *app, args []string) error {
	tc, err := a.tableOnly(ctx, args)
	if err != nil {
		return err
	}
	gs, err := dedupsql.Groups(ctx, a.pool, tc.Schema, tc.Table)
	if err != nil {
		return err
	}
	retention, err := ops.RecordedRetention(ctx, a.pool, tc)
	if err != nil {
		return err
	}
	now := time.Now()
	if a.opts.json {
		out := []ops.Group{}
		for _, g := range gs {
			out = append(out, ops.ToGroup(g, now, retention))
		}
		return a.printJSON(out)
	}
	if len(gs) == 0 {
		fmt.Fprintf(a.stdout, "no consumer group is registered with %s.%s\n", tc.Schema, tc.Table)
		return nil
	}
	tw := a.table()
	row(tw, "GROUP", "FIRST SEEN", "IDEMPOTENCY NAMESPACE", "LAST STARTED", "YOUNG")
	for _, g := range gs {
		first := ops.HumanTime(g.FirstSeen)
		if g.FirstSeen.IsZero() {
			first = "before the registry"
		}
		row(tw, g.Name, first, g.IdempotencyNamespace, ops.HumanTime(g.StartedAt), map[bool]string{true: "yes", false: "no"}[g.Young(now, retention)])
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(a.stdout, "(young: first seen less than the retention, %s, ago: its claims are all kept)\n", ops.HumanDuration(retention))
	return nil
}

func groupsRename(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	pos, err := a.parse(fs, args, "FROM", "TO")
	if err != nil {
		return err
	}
	if pos[0] == "" || pos[1] == "" || pos[0] == pos[1] {
		return usageError("usage: FROM and TO must be two different, non-empty names")
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	g, copied, err := deduplicator.RenameGroup(ctx, a.pool, tc, pos[0], pos[1])
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(struct {
			From                 string   `json:"from"`
			To                   string   `json:"to"`
			ClaimsCopied         int64    `json:"claims_copied"`
			FirstSeen            ops.Time `json:"first_seen"`
			IdempotencyNamespace string   `json:"idempotency_namespace"`
		}{pos[0], pos[1], copied, ops.Time(g.FirstSeen), g.IdempotencyNamespace})
	}
	fmt.Fprintf(a.stdout, "renamed %s to %s: %d claims copied; %s keeps the first-seen time %s and the Idempotency-Key namespace %q\n",
		pos[0], pos[1], copied, pos[1], ops.HumanTime(g.FirstSeen), g.IdempotencyNamespace)
	fmt.Fprintf(a.stdout, "%s's claims are kept: move the Kafka offsets, start the consumers as %s, then run idemctl groups forget %s --yes\n", pos[0], pos[1], pos[0])
	return nil
}

func groupsForget(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	yes := fs.Bool("yes", false, "really delete the group's claims and registration")
	pos, err := a.parse(fs, args, "GROUP")
	if err != nil {
		return err
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	if err := ops.Registered(ctx, a.pool, tc, pos[0]); err != nil {
		return err
	}
	if !*yes {
		return usageError("groups forget deletes every claim of %q: a consumer started again under that name applies every event it reads again; pass --yes to do it", pos[0])
	}
	n, err := ops.ForgetGroup(ctx, a.pool, tc, pos[0])
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(struct {
			Group         string `json:"group"`
			ClaimsDeleted int64  `json:"claims_deleted"`
		}{pos[0], n})
	}
	fmt.Fprintln(a.stdout, ops.ForgotGroup(pos[0], n))
	return nil
}

func retentionShow(ctx context.Context, a *app, args []string) error {
	tc, err := a.tableOnly(ctx, args)
	if err != nil {
		return err
	}
	r, err := ops.RecordedRetention(ctx, a.pool, tc)
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(struct {
			Table            string  `json:"table"`
			RetentionSeconds float64 `json:"retention_seconds"`
		}{tc.Schema + "." + tc.Table, r.Seconds()})
	}
	fmt.Fprintf(a.stdout, "%s.%s keeps claims for %s\n", tc.Schema, tc.Table, ops.HumanDuration(r))
	return nil
}

func retentionSet(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	yes := fs.Bool("yes", false, "confirm a shorter retention (the cleaner then deletes claims sooner)")
	force := fs.Bool("force", false, "accept a retention not longer than the consumers' default StaleMargin (1h)")
	pos, err := a.parse(fs, args, "DURATION")
	if err != nil {
		return err
	}
	d, err := parseDuration(pos[0])
	if err != nil {
		return usageError("usage: retention: %v", err)
	}
	if err := checkRetention(d, *force); err != nil {
		return err
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	old, err := ops.RecordedRetention(ctx, a.pool, tc)
	if err != nil {
		return err
	}
	if d < old && !*yes {
		return usageError("shortening the retention from %s to %s lets the cleaner delete claims sooner: a redelivery or DLQ replay older than %s is then refused as stale; pass --yes to do it", ops.HumanDuration(old), ops.HumanDuration(d), ops.HumanDuration(d))
	}
	if err := dedupsql.SetRetention(ctx, a.pool, tc.Schema, tc.Table, d); err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(struct {
			Table                    string  `json:"table"`
			PreviousRetentionSeconds float64 `json:"previous_retention_seconds"`
			RetentionSeconds         float64 `json:"retention_seconds"`
		}{tc.Schema + "." + tc.Table, old.Seconds(), d.Seconds()})
	}
	fmt.Fprintf(a.stdout, "%s.%s: retention %s (was %s); running consumers adopt it within %s", tc.Schema, tc.Table, ops.HumanDuration(d), ops.HumanDuration(old), ops.HumanDuration(deduplicator.RetentionRefreshInterval))
	if d < old {
		fmt.Fprintf(a.stdout, ", the cleaner applies it from %s on", ops.HumanDuration(2*deduplicator.RetentionRefreshInterval))
	}
	fmt.Fprintln(a.stdout)
	return nil
}
