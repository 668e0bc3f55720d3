package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/partition"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// stringsFlag is a repeatable flag that also takes comma-separated values.
type stringsFlag []string

func (s *stringsFlag) String() string { return strings.Join(*s, ",") }

// Set refuses an empty value or item: an empty --group must not mean "every
// group".
func (s *stringsFlag) Set(v string) error {
	for _, item := range strings.Split(v, ",") {
		if strings.TrimSpace(item) == "" {
			return errors.New("empty value")
		}
	}
	*s = append(*s, splitList(v)...)
	return nil
}

func dedupCheck(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	var groups stringsFlag
	fs.Var(&groups, "group", "consumer `group` to check; repeat it or separate with commas (default: every registered group)")
	pos, err := a.parse(fs, args, "EVENT_ID")
	if err != nil {
		return err
	}
	id, err := uuid.Parse(pos[0])
	if err != nil {
		return usageError("invalid event id %q: %v", pos[0], err)
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	if groups, err = checkedGroups(ctx, a, tc, groups); err != nil {
		return err
	}
	retention, err := ops.RecordedRetention(ctx, a.pool, tc)
	if err != nil {
		return err
	}
	var created time.Time
	if id.Version() == 7 {
		sec, nsec := id.Time().UnixTime()
		created = time.Unix(sec, nsec).UTC()
	}
	old := !created.IsZero() && time.Since(created) > retention

	results := make([]groupCheck, 0, len(groups))
	all := true
	for _, g := range groups {
		d, err := deduplicator.New(deduplicator.Config{TableConfig: tc, ConsumerGroup: g}, nil)
		if err != nil {
			return usageError("%v", err)
		}
		at, ok, err := d.ProcessedAt(ctx, a.pool, id)
		if err != nil {
			return err
		}
		all = all && ok
		results = append(results, groupCheck{g, ok, ops.Time(at)})
	}
	if a.opts.json {
		err = a.printJSON(struct {
			EventID            string       `json:"event_id"`
			CreatedAt          ops.Time     `json:"created_at"`
			RetentionSeconds   float64      `json:"retention_seconds"`
			OlderThanRetention bool         `json:"older_than_retention"`
			Processed          bool         `json:"processed"`
			Groups             []groupCheck `json:"groups"`
		}{id.String(), ops.Time(created), retention.Seconds(), old, all, results})
	} else {
		printCheck(a, id, created, results)
		if !all && old {
			fmt.Fprintf(a.stdout, "note: the event is older than the retention (%s): a claim may have been deleted by the cleaner, and the consumers refuse the event as stale (ErrStaleEvent) rather than apply it again\n", ops.HumanDuration(retention))
		}
	}
	if err != nil {
		return err
	}
	if !all {
		return &exitError{code: exitNo}
	}
	return nil
}

// groupCheck is one consumer group's answer to dedup check.
type groupCheck struct {
	Group       string   `json:"group"`
	Processed   bool     `json:"processed"`
	ProcessedAt ops.Time `json:"processed_at"`
}

// checkedGroups returns the groups to check: those asked for, each
// registered with the table, or every registered group.
func checkedGroups(ctx context.Context, a *app, tc deduplicator.TableConfig, groups []string) ([]string, error) {
	registered, err := dedupsql.Groups(ctx, a.pool, tc.Schema, tc.Table)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(registered))
	for i, g := range registered {
		names[i] = g.Name
	}
	if len(groups) == 0 {
		if len(names) == 0 {
			return nil, usageError("no consumer group is registered with %s.%s: pass --group", tc.Schema, tc.Table)
		}
		groups = names
	}
	for _, g := range groups {
		if !slices.Contains(names, g) {
			return nil, usageError("unknown consumer group %q: not registered with %s.%s (registered: %s)", g, tc.Schema, tc.Table, listOrNone(names))
		}
	}
	return groups, nil
}

// printCheck prints dedup check's answer as text: the event, then a row
// per group.
func printCheck(a *app, id uuid.UUID, created time.Time, results []groupCheck) {
	fmt.Fprintf(a.stdout, "event %s", id)
	if !created.IsZero() {
		fmt.Fprintf(a.stdout, ", created %s (UUIDv7 time, %s ago)", ops.HumanTime(created), ops.HumanDuration(time.Since(created)))
	}
	fmt.Fprintln(a.stdout)
	tw := a.table()
	row(tw, "GROUP", "PROCESSED", "PROCESSED AT", "AGO")
	for _, r := range results {
		ago := "-"
		if r.Processed {
			ago = ops.HumanDuration(time.Since(time.Time(r.ProcessedAt)))
		}
		row(tw, r.Group, map[bool]string{true: "yes", false: "no"}[r.Processed], ops.HumanTime(time.Time(r.ProcessedAt)), ago)
	}
	_ = tw.Flush()
}

func listOrNone(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ", ")
}

func dedupStats(ctx context.Context, a *app, args []string) error {
	tc, err := a.tableOnly(ctx, args)
	if err != nil {
		return err
	}
	st, err := readStats(ctx, a.pool, tc)
	if err != nil {
		return err
	}
	if a.opts.json {
		type group struct {
			Group      string   `json:"group"`
			Registered bool     `json:"registered"`
			Rows       int64    `json:"rows"`
			Oldest     ops.Time `json:"oldest"`
			Newest     ops.Time `json:"newest"`
		}
		type partition struct {
			ops.Partition
			Rows   int64    `json:"rows"`
			Oldest ops.Time `json:"oldest"`
			Newest ops.Time `json:"newest"`
		}
		out := struct {
			Schema           string      `json:"schema"`
			Table            string      `json:"table"`
			Layout           string      `json:"layout"`
			RetentionSeconds float64     `json:"retention_seconds"`
			CleanedBefore    ops.Time    `json:"cleaned_before"`
			Rows             int64       `json:"rows"`
			Oldest           ops.Time    `json:"oldest"`
			Newest           ops.Time    `json:"newest"`
			Bytes            int64       `json:"bytes"`
			Groups           []group     `json:"groups"`
			Partitions       []partition `json:"partitions"`
		}{st.info.Schema, st.info.Table, st.info.Layout, st.info.Retention.Seconds(), ops.Time(st.info.CleanedBefore), st.Rows,
			ops.Time(st.Oldest), ops.Time(st.Newest), st.info.Bytes, []group{}, []partition{}}
		for _, g := range st.groups {
			out.Groups = append(out.Groups, group{g.Group, g.Registered, g.Rows, ops.Time(g.Oldest), ops.Time(g.Newest)})
		}
		for _, p := range st.partitions {
			out.Partitions = append(out.Partitions, partition{ops.ToPartition(p.Info), p.Rows, ops.Time(p.Oldest), ops.Time(p.Newest)})
		}
		return a.printJSON(out)
	}
	fmt.Fprintf(a.stdout, "table %s.%s (%s): %d rows, %s on disk, retention %s, cleaned before %s\n",
		st.info.Schema, st.info.Table, st.info.Layout, st.Rows, ops.HumanBytes(st.info.Bytes), ops.HumanDuration(st.info.Retention), ops.HumanTime(st.info.CleanedBefore))
	fmt.Fprintf(a.stdout, "processed_at: oldest %s, newest %s\n\n", ops.HumanTime(st.Oldest), ops.HumanTime(st.Newest))
	tw := a.table()
	row(tw, "GROUP", "REGISTERED", "ROWS", "OLDEST", "NEWEST")
	for _, g := range st.groups {
		row(tw, g.Group, map[bool]string{true: "yes", false: "no"}[g.Registered], g.Rows, ops.HumanTime(g.Oldest), ops.HumanTime(g.Newest))
	}
	if len(st.groups) == 0 {
		row(tw, "(none)")
	}
	_ = tw.Flush()
	if len(st.partitions) == 0 {
		return nil
	}
	fmt.Fprintln(a.stdout)
	tw = a.table()
	row(tw, "PARTITION", "EVENTS FROM", "TO", "ROWS", "SIZE", "OLDEST", "NEWEST")
	for _, p := range st.partitions {
		from, to := partitionRange(p.Info)
		row(tw, p.Name, from, to, p.Rows, ops.HumanBytes(p.Bytes), ops.HumanTime(p.Oldest), ops.HumanTime(p.Newest))
	}
	return tw.Flush()
}

// partitionRange prints a partition's event-time range for a table.
func partitionRange(p partition.Info) (from, to string) {
	switch {
	case p.Default:
		return "(default)", "-"
	case p.From.IsZero():
		return p.Bound, ""
	}
	return ops.HumanTime(p.From), ops.HumanTime(p.To)
}

func dedupConvert(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	group := fs.String("group", "", "consumer `group` that processed the rows without one (a table without consumer_group, or its NULL ones)")
	retention := fs.String("retention", "", "retention the converted table records when it has none yet (7d, 720h...; default 7d)")
	dryRun := fs.Bool("dry-run", false, "convert inside a transaction and roll it back: report the rows kept and merged, change nothing")
	force := fs.Bool("force", false, "accept a --retention not longer than the consumers' default StaleMargin (1h)")
	groupSet := false
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	fs.Visit(func(f *flag.Flag) { groupSet = groupSet || f.Name == "group" })
	if groupSet && *group == "" {
		return usageError("usage: --group: empty value")
	}
	tc, err := a.tableConfig(ctx, false)
	if err != nil {
		return err
	}
	if *retention != "" {
		if tc.Retention, err = parseDuration(*retention); err != nil {
			return usageError("usage: --retention: %v", err)
		}
		if err := checkRetention(tc.Retention, *force); err != nil {
			return err
		}
	}
	res, err := deduplicator.ConvertTable(ctx, a.pool, tc, deduplicator.ConvertOptions{ConsumerGroup: *group, DryRun: *dryRun})
	if err != nil {
		var terr *migrate.TableError
		if errors.As(err, &terr) && !errors.Is(err, deduplicator.ErrTableMissing) {
			// What the table holds, or an option to set: nothing changed.
			return &exitError{code: exitUsage, err: fmt.Errorf("%s: %s; fix: %s", terr.Table, convertFix(terr.Problem), convertFix(terr.Fix))}
		}
		return err
	}
	name := tc.Schema + "." + tc.Table
	if a.opts.json {
		return a.printJSON(struct {
			Table       string `json:"table"`
			Layout      string `json:"layout"`
			DryRun      bool   `json:"dry_run"`
			Converted   bool   `json:"converted"`
			Was         string `json:"was"`
			Rows        int64  `json:"rows"`
			Kept        int64  `json:"kept"`
			Merged      int64  `json:"merged"`
			GroupFilled int64  `json:"group_filled"`
		}{name, tc.Layout.String(), res.DryRun, res.Converted, res.Was, res.Rows, res.Kept, res.Collapsed, res.GroupFilled})
	}
	switch {
	case !res.Converted && res.DryRun:
		fmt.Fprintf(a.stdout, "dry run: %s already has the expected columns and key: nothing to convert (only pending migrations would run); nothing was changed\n", name)
		return nil
	case !res.Converted:
		fmt.Fprintf(a.stdout, "%s already has the expected columns and key: nothing converted (pending migrations applied)\n", name)
		return nil
	case res.DryRun:
		fmt.Fprintf(a.stdout, "dry run on %s (to %s): nothing was changed\n", name, tc.Layout)
	default:
		fmt.Fprintf(a.stdout, "converted %s (%s)\n", name, tc.Layout)
	}
	would := map[bool]string{true: "would be ", false: ""}[res.DryRun]
	tw := a.table()
	row(tw, "was", res.Was)
	row(tw, "rows", res.Rows)
	row(tw, "rows "+would+"kept", res.Kept)
	row(tw, "rows "+would+"merged", fmt.Sprintf("%d (an (event, group) stored more than once: the earliest processed_at is kept)", res.Collapsed))
	if res.GroupFilled > 0 {
		row(tw, "rows "+would+"given group "+*group, res.GroupFilled)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if !res.DryRun {
		fmt.Fprintf(a.stdout, "grants, triggers and other indexes of the old table were not carried over: grant them again\n")
	}
	return nil
}

// convertFix words the library's problem or fix for the command line.
func convertFix(s string) string {
	return strings.NewReplacer(
		"set ConvertOptions.ConsumerGroup (idemctl dedup convert --group) to", "pass --group naming",
		"leave ConvertOptions.ConsumerGroup empty", "drop --group",
		"ConvertOptions.ConsumerGroup is empty", "--group is not set",
		"ConvertOptions.ConsumerGroup is set", "--group is set",
	).Replace(s)
}
