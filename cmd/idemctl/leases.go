package main

import (
	"context"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"time"

	"github.com/google/uuid"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
)

// dedupLeases lists lease mode's leases: live ones are calls in flight (or
// owners that vanished less than a lease ago), expired ones wait for their
// event's next delivery to take them over.
func dedupLeases(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	group := fs.String("group", "", "only this consumer `group`")
	state := fs.String("state", "", "live or expired (default: both)")
	limit := fs.Int("limit", 100, "at most `N` leases, oldest taken first")
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	if *state != "" && *state != "live" && *state != "expired" {
		return usageError("--state %q: want live or expired", *state)
	}
	if *limit < 1 {
		return usageError("--limit must be positive")
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	ls, err := leasesql.List(ctx, a.pool, tc.Schema, tc.Table, leasesql.Filter{ConsumerGroup: *group, State: *state, Limit: *limit})
	if err != nil {
		return err
	}
	if a.opts.json {
		if ls == nil {
			ls = []leasesql.Lease{}
		}
		return a.printJSON(struct {
			Leases []leasesql.Lease `json:"leases"`
		}{ls})
	}
	if len(ls) == 0 {
		fmt.Fprintln(a.stdout, "no leases")
		return nil
	}
	tw := a.table()
	row(tw, "EVENT", "GROUP", "STATE", "TAKEN", "EXPIRES", "ATTEMPTS", "OWNER")
	for _, l := range ls {
		st := "live"
		if l.Expired {
			st = "expired"
		}
		row(tw, l.EventID.String(), l.ConsumerGroup, st, ops.HumanTime(l.TakenAt), ops.HumanTime(l.ExpiresAt), fmt.Sprint(l.Attempts), l.Owner)
	}
	return tw.Flush()
}

// dedupRelease deletes one lease, whoever holds it: for an owner known to
// be gone, so the event's next delivery need not wait for the expiry.
func dedupRelease(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	group := fs.String("group", "", "the lease's consumer `group` (required)")
	yes := fs.Bool("yes", false, "really release it")
	pos, err := a.parse(fs, args, "EVENT_ID")
	if err != nil {
		return err
	}
	id, err := uuid.Parse(pos[0])
	if err != nil {
		return ops.Input("invalid event id %q: %v", pos[0], err)
	}
	if *group == "" {
		return usageError("--group is required")
	}
	if !*yes {
		return usageError("dedup release lets the next delivery of %s run its handler at once; an owner still calling then loses its lease and writes nothing (its call stands, under the same Idempotency-Key); pass --yes to do it", id)
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	_, ok, err := ops.ReleaseLease(ctx, a.pool, tc, id.String(), *group)
	if err != nil {
		return err
	}
	if a.opts.json {
		return a.printJSON(struct {
			EventID  string `json:"event_id"`
			Group    string `json:"group"`
			Released bool   `json:"released"`
		}{id.String(), *group, ok})
	}
	if !ok {
		fmt.Fprintln(a.stdout, ops.NoLease(id, *group))
		return nil
	}
	fmt.Fprintf(a.stdout, "released the lease of %s for %s at %s\n", id, *group, ops.HumanTime(time.Now()))
	return nil
}
