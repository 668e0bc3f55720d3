package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// selection is what --only names: the dedup table, the outbox topics'
// tables, retrytopic's parked-keys table, the console's tables (its audit
// trail and the instances' heartbeat).
type selection struct{ dedup, outbox, retry, console bool }

// only validates --only: a comma-separated list of dedup, outbox, retry and
// console ("" or "all": every one).
func only(v string) (selection, error) {
	if v == "" || v == "all" {
		return selection{true, true, true, true}, nil
	}
	var s selection
	for _, part := range splitList(v) {
		switch part {
		case "dedup":
			s.dedup = true
		case "outbox":
			s.outbox = true
		case "retry":
			s.retry = true
		case "console":
			s.console = true
		default:
			return s, usageError("usage: --only %q: want dedup, outbox, retry or console (comma-separated)", v)
		}
	}
	return s, nil
}

// single reports whether one kind of table is selected: the kinds' versions
// differ, so --target needs it.
func (s selection) single() bool {
	n := 0
	for _, b := range []bool{s.dedup, s.outbox, s.retry, s.console} {
		if b {
			n++
		}
	}
	return n == 1
}

// migrators is one Migrator over the selected lines: the dedup table, one
// line per outbox topic, the parked-keys table.
type migrators struct {
	m   *migrate.Migrator
	sel selection
	tc  deduplicator.TableConfig
	ob  outbox.Config // Topics: the lines' topics
	rt  retrytopic.ParkedKeysTable
	// schema holds the console's tables (--schema).
	schema string
}

// lines returns the selected lines, in the order up runs them.
func (m *migrators) lines() []migrate.Line {
	var lines []migrate.Line
	if m.sel.dedup {
		lines = append(lines, deduplicator.MigrationLine(m.tc))
	}
	if m.sel.outbox {
		for _, topic := range m.ob.Topics {
			lines = append(lines, outbox.MigrationLine(m.ob, topic))
		}
	}
	if m.sel.retry {
		lines = append(lines, retrytopic.MigrationLine(m.rt))
	}
	if m.sel.console {
		lines = append(lines, failures.MigrationLines(m.schema)...)
	}
	return lines
}

// build makes the Migrator of the selected lines on db (nil: render only).
func (m *migrators) build(db migrate.Beginner) error {
	var err error
	if m.m, err = migrate.New(db, m.lines()...); err != nil {
		return usageError("%v", err)
	}
	return nil
}

func (a *app) parkedTable(name string) retrytopic.ParkedKeysTable {
	return retrytopic.ParkedKeysTable{Schema: a.opts.schema, Table: name}
}

func (a *app) migrators(ctx context.Context, onlyFlag, parked, payload string, retention time.Duration) (*migrators, error) {
	sel, err := only(onlyFlag)
	if err != nil {
		return nil, err
	}
	pool, err := a.connect(ctx)
	if err != nil {
		return nil, err
	}
	m := &migrators{sel: sel, rt: a.parkedTable(parked), schema: a.opts.schema}
	if sel.dedup {
		if m.tc, err = a.tableConfig(ctx, true); err != nil {
			return nil, err
		}
		m.tc.Retention = retention
	}
	if sel.outbox {
		if m.ob, err = a.outboxConfig(ctx, true); err != nil {
			return nil, err
		}
		m.ob.PayloadType = payload
		if len(m.ob.Topics) == 0 && !sel.dedup && !sel.retry && !sel.console {
			return nil, usageError("no outbox topic: none is recorded under prefix %s in %s.idem_schema_migration; pass --topics", m.ob.TablePrefix, m.ob.Schema)
		}
	}
	return m, m.build(pool)
}

type jsonVersion struct {
	Component string   `json:"component"`
	Version   int      `json:"version"`
	Name      string   `json:"name"`
	Status    string   `json:"status"`
	AppliedAt ops.Time `json:"applied_at"`
}

func statusWord(s migrate.MigrationStatus) string {
	switch {
	case s.Unknown:
		return "unknown"
	case s.Applied:
		return "applied"
	}
	return "pending"
}

type jsonCheck struct {
	Target  string `json:"target"`
	OK      bool   `json:"ok"`
	Problem string `json:"problem,omitempty"`
}

const (
	onlyUsage   = "`tables` to act on, comma-separated: dedup, outbox, retry, console (default all)"
	parkedUsage = "parked-keys `table` of retry topics' KeyOrder, in --schema"
	// parkedTableDefault is retrytopic.ParkedKeysTable.Table's default.
	parkedTableDefault = "retry_parked_key"
)

func migrateStatus(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	onlyFlag := fs.String("only", "", onlyUsage)
	parked := fs.String("parked-table", parkedTableDefault, parkedUsage)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	m, err := a.migrators(ctx, *onlyFlag, *parked, "", 0)
	if err != nil {
		return err
	}
	st, err := m.m.Status(ctx)
	if err != nil {
		return err
	}
	// The live tables' checks: what a service would refuse at start-up.
	var checks []jsonCheck
	if m.sel.dedup {
		c := jsonCheck{Target: m.tc.Schema + "." + m.tc.Table + " (" + m.tc.Layout.String() + ")", OK: true}
		if err := deduplicator.Check(ctx, a.pool, m.tc); err != nil {
			c.OK, c.Problem = false, err.Error()
		}
		checks = append(checks, c)
	}
	if m.sel.outbox && len(m.ob.Topics) > 0 {
		ob, err := outbox.New(m.ob, nil)
		if err != nil {
			return err
		}
		for _, topic := range m.ob.Topics {
			c := jsonCheck{Target: "outbox topic " + topic, OK: true}
			if err := ob.Check(ctx, a.pool, topic); err != nil {
				c.OK, c.Problem = false, err.Error()
			}
			checks = append(checks, c)
		}
	}
	counts := map[string]int{}
	for _, s := range st {
		counts[statusWord(s)]++
	}
	if a.opts.json {
		out := struct {
			Versions []jsonVersion `json:"versions"`
			Applied  int           `json:"applied"`
			Pending  int           `json:"pending"`
			Unknown  int           `json:"unknown"`
			Checks   []jsonCheck   `json:"checks"`
		}{Versions: []jsonVersion{}, Applied: counts["applied"], Pending: counts["pending"], Unknown: counts["unknown"], Checks: checks}
		for _, s := range st {
			out.Versions = append(out.Versions, jsonVersion{s.Component, s.Version, s.Name, statusWord(s), ops.Time(s.AppliedAt)})
		}
		return a.printJSON(out)
	}
	tw := a.table()
	row(tw, "COMPONENT", "VERSION", "NAME", "STATUS", "APPLIED AT")
	for _, s := range st {
		row(tw, s.Component, s.Version, s.Name, statusWord(s), ops.HumanTime(s.AppliedAt))
	}
	_ = tw.Flush()
	fmt.Fprintf(a.stdout, "\n%d applied, %d pending, %d unknown", counts["applied"], counts["pending"], counts["unknown"])
	if counts["unknown"] > 0 {
		fmt.Fprint(a.stdout, " (recorded by another layout or a newer release: migrate down refuses to go past them)")
	}
	fmt.Fprintln(a.stdout)
	if m.sel.outbox && len(m.ob.Topics) == 0 && m.ob.TablePrefix != "" && *onlyFlag == "" {
		fmt.Fprintf(a.stdout, "no outbox topic recorded under prefix %s in schema %s (pass --topics to name some)\n", m.ob.TablePrefix, m.ob.Schema)
	}
	fmt.Fprintln(a.stdout)
	for _, c := range checks {
		if c.OK {
			fmt.Fprintf(a.stdout, "check %s: ok\n", c.Target)
		} else {
			fmt.Fprintf(a.stdout, "check %s: %s\n", c.Target, c.Problem)
		}
	}
	return nil
}

type jsonStep struct {
	Component  string  `json:"component"`
	Version    int     `json:"version"`
	Name       string  `json:"name"`
	DurationMS float64 `json:"duration_ms"`
}

func (a *app) printSteps(direction migrate.Direction, dryRun bool, steps []migrate.MigrateVersion) error {
	if a.opts.json {
		out := struct {
			Direction migrate.Direction `json:"direction"`
			DryRun    bool              `json:"dry_run"`
			Versions  []jsonStep        `json:"versions"`
		}{direction, dryRun, []jsonStep{}}
		for _, s := range steps {
			out.Versions = append(out.Versions, jsonStep{s.Component, s.Version, s.Name, float64(s.Duration.Microseconds()) / 1000})
		}
		return a.printJSON(out)
	}
	verb, done := "apply", "applied"
	if direction == migrate.DirectionDown {
		verb, done = "revert", "reverted"
	}
	if len(steps) == 0 {
		fmt.Fprintf(a.stdout, "nothing to %s\n", verb)
		return nil
	}
	tw := a.table()
	for _, s := range steps {
		if dryRun {
			row(tw, "would "+verb, s.Component, fmt.Sprintf("%03d_%s", s.Version, s.Name))
		} else {
			row(tw, done, s.Component, fmt.Sprintf("%03d_%s", s.Version, s.Name), ops.HumanDuration(s.Duration))
		}
	}
	return tw.Flush()
}

func migrateUp(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	onlyFlag := fs.String("only", "", onlyUsage)
	parked := fs.String("parked-table", parkedTableDefault, parkedUsage)
	target := fs.Int("target", 0, "apply the versions up to this `version` only (needs --only naming one kind)")
	retention := fs.String("retention", "", "retention a new processed_event table records (7d, 720h...; default 7d); an existing table's must match")
	payload := fs.String("payload-type", "", "payload column type of new outbox tables: BYTEA, JSON or JSONB (default BYTEA)")
	dryRun := fs.Bool("dry-run", false, "list the versions it would apply, change nothing")
	force := fs.Bool("force", false, "accept a --retention not longer than the consumers' default StaleMargin (1h)")
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	sel, err := only(*onlyFlag)
	if err != nil {
		return err
	}
	if *target != 0 && !sel.single() {
		return usageError("usage: --target needs --only dedup, outbox or retry (their versions differ)")
	}
	if *target < 0 {
		return usageError("usage: --target %d: going up it must be a version", *target)
	}
	var ret time.Duration
	if *retention != "" {
		if ret, err = parseDuration(*retention); err != nil {
			return usageError("usage: --retention: %v", err)
		}
		if err := checkRetention(ret, *force); err != nil {
			return err
		}
	}
	m, err := a.migrators(ctx, *onlyFlag, *parked, *payload, ret)
	if err != nil {
		return err
	}
	if *dryRun {
		st, err := m.m.Status(ctx)
		if err != nil {
			return err
		}
		var steps []migrate.MigrateVersion
		for _, s := range st {
			if !s.Applied && (*target == 0 || s.Version <= *target) {
				steps = append(steps, migrate.MigrateVersion{Component: s.Component, Version: s.Version, Name: s.Name})
			}
		}
		return a.printSteps(migrate.DirectionUp, true, steps)
	}
	res, err := m.m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: *target})
	if err != nil {
		if len(res.Versions) > 0 {
			_ = a.printSteps(migrate.DirectionUp, false, res.Versions)
		}
		return err
	}
	return a.printSteps(migrate.DirectionUp, false, res.Versions)
}

// downPlan lists, from st, what a down migration to target reverts, by
// MigrateOpts.TargetVersion's rules: 0 the newest applied version of each
// component, N the applied versions above N, -1 every applied version;
// newest first within a component, the components backwards.
func downPlan(st []migrate.MigrationStatus, target int) (plan []migrate.MigrateVersion, unknown []migrate.MigrationStatus) {
	byComp := map[string][]migrate.MigrationStatus{}
	var order []string
	for _, s := range st {
		if _, ok := byComp[s.Component]; !ok {
			order = append(order, s.Component)
		}
		byComp[s.Component] = append(byComp[s.Component], s)
	}
	slices.Reverse(order)
	for _, c := range order {
		vs := byComp[c]
		newest := 0
		for _, s := range vs {
			if s.Applied && !s.Unknown && s.Version > newest {
				newest = s.Version
			}
			if s.Unknown && s.Version > target {
				unknown = append(unknown, s)
			}
		}
		for i := len(vs) - 1; i >= 0; i-- {
			s := vs[i]
			if !s.Applied || s.Unknown || s.Version <= target || (target == 0 && s.Version != newest) {
				continue
			}
			plan = append(plan, migrate.MigrateVersion{Component: s.Component, Version: s.Version, Name: s.Name})
		}
	}
	return plan, unknown
}

func migrateDown(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	onlyFlag := fs.String("only", "", onlyUsage)
	parked := fs.String("parked-table", parkedTableDefault, parkedUsage)
	target := fs.Int("target", 0, "revert the versions above this `version` (default: only the newest of each component)")
	all := fs.Bool("all", false, "revert every version: drop the tables and their rows")
	dryRun := fs.Bool("dry-run", false, "list the versions it would revert, change nothing")
	yes := fs.Bool("yes", false, "really revert (a down migration drops tables or columns, with their rows)")
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	sel, err := only(*onlyFlag)
	if err != nil {
		return err
	}
	switch {
	case *all && *target != 0:
		return usageError("usage: --all and --target exclude each other")
	case *target < 0:
		return usageError("usage: --target %d: use --all to revert every version", *target)
	case *target > 0 && !sel.single():
		return usageError("usage: --target needs --only dedup, outbox or retry (their versions differ)")
	}
	if *all {
		*target = -1
	}
	m, err := a.migrators(ctx, *onlyFlag, *parked, "", 0)
	if err != nil {
		return err
	}
	st, err := m.m.Status(ctx)
	if err != nil {
		return err
	}
	plan, unknown := downPlan(st, *target)
	if *dryRun {
		for _, u := range unknown {
			fmt.Fprintf(a.stderr, "%s: warning: %s version %d (%s) is recorded but unknown to this release: migrate down refuses to revert past it\n", a.path, u.Component, u.Version, u.Name)
		}
		return a.printSteps(migrate.DirectionDown, true, plan)
	}
	if len(plan) == 0 && len(unknown) == 0 {
		return a.printSteps(migrate.DirectionDown, false, nil)
	}
	if !*yes {
		names := make([]string, len(plan))
		for i, p := range plan {
			names[i] = fmt.Sprintf("%s %03d_%s", p.Component, p.Version, p.Name)
		}
		return usageError("migrate down would revert %s, dropping tables or columns with their rows: pass --yes to do it (--dry-run lists it)", strings.Join(names, ", "))
	}
	res, err := m.m.Migrate(ctx, migrate.DirectionDown, &migrate.MigrateOpts{TargetVersion: *target})
	if err != nil {
		if len(res.Versions) > 0 {
			_ = a.printSteps(migrate.DirectionDown, false, res.Versions)
		}
		return err
	}
	return a.printSteps(migrate.DirectionDown, false, res.Versions)
}

func migrateSQL(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	onlyFlag := fs.String("only", "", onlyUsage)
	parked := fs.String("parked-table", parkedTableDefault, parkedUsage)
	down := fs.Bool("down", false, "print the down migrations (newest first) instead of the up ones")
	pending := fs.Bool("pending", false, "only the versions the database has not recorded (connects; without it nothing connects and --layout auto means plain)")
	payload := fs.String("payload-type", "", "payload column type of the outbox tables: BYTEA, JSON or JSONB (default BYTEA)")
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	sel, err := only(*onlyFlag)
	if err != nil {
		return err
	}
	var migs []migrate.Migration
	if *pending {
		if *down {
			return usageError("usage: --pending and --down exclude each other")
		}
		m, err := a.migrators(ctx, *onlyFlag, *parked, *payload, 0)
		if err != nil {
			return err
		}
		res, err := m.m.Validate(ctx)
		if err != nil {
			return err
		}
		migs = res.Pending
	} else if migs, err = offlineMigrations(ctx, a, sel, *parked, *payload); err != nil {
		return err
	}
	if *down {
		slices.Reverse(migs)
	}
	if a.opts.json {
		type jsonMigration struct {
			Component string `json:"component"`
			Version   int    `json:"version"`
			Name      string `json:"name"`
			Up        string `json:"up"`
			Down      string `json:"down"`
		}
		out := []jsonMigration{}
		for _, m := range migs {
			out = append(out, jsonMigration{m.Component, m.Version, m.Name, m.Up, m.Down})
		}
		return a.printJSON(out)
	}
	if len(migs) == 0 {
		fmt.Fprintln(a.stdout, "-- nothing pending")
		return nil
	}
	for i, m := range migs {
		if i > 0 {
			fmt.Fprintln(a.stdout)
		}
		sql, dir := m.Up, "up"
		if *down {
			sql, dir = m.Down, "down"
		}
		fmt.Fprintf(a.stdout, "-- %s %03d_%s.%s.sql\n%s", m.Component, m.Version, m.Name, dir, sql)
		if !strings.HasSuffix(sql, "\n") {
			fmt.Fprintln(a.stdout)
		}
	}
	return nil
}

// offlineMigrations returns the migrations of the components sel selects
// without connecting: the layout is --layout (auto means plain) and the
// outbox's topics come from --topics.
func offlineMigrations(ctx context.Context, a *app, sel selection, parked, payload string) ([]migrate.Migration, error) {
	m := &migrators{sel: sel, rt: a.parkedTable(parked), schema: a.opts.schema}
	if sel.dedup {
		m.tc = deduplicator.TableConfig{Schema: a.opts.schema, Table: a.opts.table}
		switch a.opts.layout {
		case "auto", "", "plain":
		case "partitioned":
			m.tc.Layout = deduplicator.LayoutPartitioned
		default:
			return nil, usageError("usage: --layout %q: want auto, plain or partitioned", a.opts.layout)
		}
	}
	if sel.outbox {
		var err error
		if m.ob, err = a.outboxConfig(ctx, false); err != nil {
			return nil, err
		}
		m.ob.PayloadType = payload
		if len(m.ob.Topics) == 0 && sel.single() {
			return nil, usageError("usage: migrate sql --only outbox needs --topics (it does not connect to find them)")
		}
	}
	if err := m.build(nil); err != nil {
		return nil, err
	}
	migs, err := m.m.Migrations()
	if err != nil {
		return nil, usageError("%v", err)
	}
	return migs, nil
}

// parseDuration accepts Go durations and whole days ("7d", "30d"); a value
// too large for a time.Duration (about 106751 days) is an error, never a
// wrapped-around one.
func parseDuration(s string) (time.Duration, error) {
	if n, ok := strings.CutSuffix(s, "d"); ok && n != "" && strings.Trim(n, "0123456789") == "" {
		days, err := strconv.ParseInt(n, 10, 64)
		if err != nil || days > maxDays {
			return 0, fmt.Errorf("%q is too long: at most %dd", s, maxDays)
		}
		if days <= 0 {
			return 0, errors.New("must be positive")
		}
		return time.Duration(days) * day, nil
	}
	d, err := time.ParseDuration(s) // checks overflow itself
	if err != nil {
		return 0, fmt.Errorf("%q is not a duration (7d, 720h, 90m...), or is longer than %dd", s, maxDays)
	}
	if d <= 0 {
		return 0, errors.New("must be positive")
	}
	return d, nil
}

const (
	day = 24 * time.Hour
	// maxDays is the longest whole-day duration a time.Duration holds.
	maxDays = int64(math.MaxInt64 / day)
)

// checkRetention refuses, unless force, a retention at or below the
// consumers' default stale margin: NewDedup requires StaleMargin to be
// shorter than the retention, so every consumer on the default would refuse
// to start.
func checkRetention(d time.Duration, force bool) error {
	if d > deduplicator.DefaultStaleMargin || force {
		return nil
	}
	return usageError("a retention of %s is not longer than the consumers' default StaleMargin (%s): every consumer that keeps the default refuses to start (NewDedup: StaleMargin must be shorter than the retention); pass --force if every consumer sets a shorter StaleMargin", ops.HumanDuration(d), ops.HumanDuration(deduplicator.DefaultStaleMargin))
}
