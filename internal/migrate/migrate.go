// Package migrate applies embedded, versioned SQL migrations: one transaction
// per version, serialised across processes by an advisory lock, recorded in a
// migration table shared by every component of the library.
package migrate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// Beginner begins a transaction: *pgxpool.Pool, *pgx.Conn and pgx.Tx all fit.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Querier reads: a pgx.Tx, a *pgx.Conn or a *pgxpool.Pool.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Migration is one version, rendered for a schema and table.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

// Table is the migration bookkeeping table, created in the target schema.
const Table = "idem_schema_migration"

var fileRe = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// Load reads NNN_name.up.sql / NNN_name.down.sql templates from fsys (its
// root), and renders each with data. Templates may call {{ident "a" "b"}} to
// quote identifiers.
func Load(fsys fs.FS, data any) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, err
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		m := fileRe.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		v, _ := strconv.Atoi(m[1])
		raw, err := fs.ReadFile(fsys, path.Clean(e.Name()))
		if err != nil {
			return nil, err
		}
		tpl, err := template.New(e.Name()).Funcs(template.FuncMap{"ident": ident.Quote}).Option("missingkey=error").Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", e.Name(), err)
		}
		var buf bytes.Buffer
		if err := tpl.Execute(&buf, data); err != nil {
			return nil, fmt.Errorf("render %s: %w", e.Name(), err)
		}
		mig := byVersion[v]
		if mig == nil {
			mig = &Migration{Version: v, Name: m[2]}
			byVersion[v] = mig
		}
		if m[3] == "up" {
			mig.Up = buf.String()
		} else {
			mig.Down = buf.String()
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		if m.Up == "" {
			return nil, fmt.Errorf("migration %d_%s has no up file", m.Version, m.Name)
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Direction is the way [Migrate] goes.
type Direction string

// The directions.
const (
	DirectionUp   Direction = "up"
	DirectionDown Direction = "down"
)

// Line is one component's chain of versions, recorded in the migration table
// under Component: a processed_event table, or one outbox topic's tables.
type Line struct {
	Component string
	// Migrations in ascending version order.
	Migrations []Migration
	// Verify, when set, runs in the transaction of every version going up,
	// after its SQL and before its record: an error rolls the version back.
	// It is how tables that an unversioned CREATE TABLE IF NOT EXISTS made
	// earlier are adopted as version 1 only when their shape matches.
	Verify func(ctx context.Context, tx pgx.Tx, m Migration) error
}

// Options narrow a run of [Migrate].
type Options struct {
	// TargetVersion going up applies the versions up to and including it (0:
	// all of them). Going down it reverts the versions above it; 0 reverts
	// only the newest applied version of each line, -1 every version. When
	// set (> 0) it must be a version of every line.
	TargetVersion int
}

// Step is one version applied or reverted.
type Step struct {
	Component string
	Version   int
	Name      string
	Duration  time.Duration
}

// ErrUnknownVersion is returned going down when the migration table records
// a version of a line that the line does not have (another layout, or a
// newer release of the library): reverting around it could drop tables it
// relies on.
var ErrUnknownVersion = errors.New("recorded but unknown to this migrator")

// Migrate applies (up) or reverts (down) the versions of lines in schema,
// each in its own transaction (a savepoint when db is a pgx.Tx) that takes
// the schema's migration lock and re-reads whether the version is applied,
// so concurrent callers apply each version once. Up goes line by line,
// oldest version first; down goes backwards. It returns the steps it took,
// also when it fails part way (the failing version is rolled back alone).
func Migrate(ctx context.Context, db Beginner, schema string, dir Direction, lines []Line, opts Options) ([]Step, error) {
	if err := ident.Validate("schema", schema); err != nil {
		return nil, err
	}
	if err := checkTarget(dir, lines, opts.TargetVersion); err != nil {
		return nil, err
	}
	if dir == DirectionDown {
		return down(ctx, db, schema, lines, opts.TargetVersion)
	}
	var steps []Step
	for _, l := range lines {
		for _, m := range l.Migrations {
			if opts.TargetVersion > 0 && m.Version > opts.TargetVersion {
				break
			}
			start := time.Now()
			done, err := inTx(ctx, db, schema, l.Component, m.Version, func(tx pgx.Tx, applied bool) (bool, error) {
				if applied {
					return false, nil
				}
				if _, err := tx.Exec(ctx, m.Up); err != nil {
					return false, err
				}
				if l.Verify != nil {
					if err := l.Verify(ctx, tx, m); err != nil {
						return false, err
					}
				}
				_, err := tx.Exec(ctx, "INSERT INTO "+ident.Quote(schema, Table)+" (component, version, name) VALUES ($1, $2, $3)", l.Component, m.Version, m.Name)
				return err == nil, err
			})
			if err != nil {
				return steps, fmt.Errorf("migration %s %d_%s: %w", l.Component, m.Version, m.Name, err)
			}
			if done {
				steps = append(steps, Step{Component: l.Component, Version: m.Version, Name: m.Name, Duration: time.Since(start)})
			}
		}
	}
	return steps, nil
}

// checkTarget refuses a direction or a target version that means nothing.
func checkTarget(dir Direction, lines []Line, target int) error {
	switch {
	case dir != DirectionUp && dir != DirectionDown:
		return fmt.Errorf("direction %q: want %q or %q", dir, DirectionUp, DirectionDown)
	case dir == DirectionUp && target < 0:
		return fmt.Errorf("target version %d: going up it must be 0 (every version) or a version", target)
	case target < -1:
		return fmt.Errorf("target version %d: going down it must be -1 (every version), 0 (one step) or a version", target)
	case target <= 0:
		return nil
	}
	for _, l := range lines {
		if !slices.ContainsFunc(l.Migrations, func(m Migration) bool { return m.Version == target }) {
			return fmt.Errorf("target version %d is not a version of %s", target, l.Component)
		}
	}
	return nil
}

// down reverts, line by line from the last, the applied versions above
// target (target 0: the newest applied one of each line), newest first.
func down(ctx context.Context, db Beginner, schema string, lines []Line, target int) ([]Step, error) {
	var steps []Step
	for i := len(lines) - 1; i >= 0; i-- {
		l := lines[i]
		recorded, err := readRecorded(ctx, db, schema, l.Component)
		if err != nil {
			return steps, fmt.Errorf("migration %s down: %w", l.Component, err)
		}
		known := map[int]bool{}
		newest := 0
		for _, m := range l.Migrations {
			known[m.Version] = true
			if recorded[m.Version] {
				newest = m.Version
			}
		}
		for v := range recorded {
			if !known[v] && v > target {
				return steps, fmt.Errorf("migration %s down: version %d: %w", l.Component, v, ErrUnknownVersion)
			}
		}
		for j := len(l.Migrations) - 1; j >= 0; j-- {
			m := l.Migrations[j]
			if m.Version <= target || (target == 0 && m.Version != newest) {
				continue
			}
			start := time.Now()
			done, err := inTx(ctx, db, schema, l.Component, m.Version, func(tx pgx.Tx, applied bool) (bool, error) {
				if !applied {
					return false, nil
				}
				if m.Down == "" {
					return false, errors.New("no down migration")
				}
				if _, err := tx.Exec(ctx, m.Down); err != nil {
					return false, err
				}
				_, err := tx.Exec(ctx, "DELETE FROM "+ident.Quote(schema, Table)+" WHERE component = $1 AND version = $2", l.Component, m.Version)
				return err == nil, err
			})
			if err != nil {
				return steps, fmt.Errorf("migration %s %d_%s down: %w", l.Component, m.Version, m.Name, err)
			}
			if done {
				steps = append(steps, Step{Component: l.Component, Version: m.Version, Name: m.Name, Duration: time.Since(start)})
			}
		}
	}
	return steps, nil
}

// readRecorded returns the versions recorded for component, in a
// transaction of its own that only reads.
func readRecorded(ctx context.Context, db Beginner, schema, component string) (map[int]bool, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	return recordedVersions(ctx, tx, schema, component)
}

// recordedVersions returns the versions schema's migration table records for
// component; none without a migration table.
func recordedVersions(ctx context.Context, db Querier, schema, component string) (map[int]bool, error) {
	recorded := map[int]bool{}
	exists, err := tableExists(ctx, db, schema)
	if err != nil || !exists {
		return recorded, err
	}
	rows, err := db.Query(ctx, "SELECT version FROM "+ident.Quote(schema, Table)+" WHERE component = $1", component)
	if err != nil {
		return nil, err
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, err
	}
	for _, v := range versions {
		recorded[int(v)] = true
	}
	return recorded, nil
}

// Pending returns the versions of migrations (in their order) that schema's
// migration table does not record for component. Without a migration table
// every version is pending. It only reads.
func Pending(ctx context.Context, db Querier, schema, component string, migrations []Migration) ([]int, error) {
	if err := ident.Validate("schema", schema); err != nil {
		return nil, err
	}
	recorded, err := recordedVersions(ctx, db, schema, component)
	if err != nil {
		return nil, fmt.Errorf("pending migrations of %s: %w", component, err)
	}
	var pending []int
	for _, m := range migrations {
		if !recorded[m.Version] {
			pending = append(pending, m.Version)
		}
	}
	return pending, nil
}

// createTableSQL creates schema's migration table if it is missing.
func createTableSQL(schema string) string {
	return `CREATE TABLE IF NOT EXISTS ` + ident.Quote(schema, Table) + ` (
	component  text        NOT NULL,
	version    integer     NOT NULL,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (component, version)
)`
}

var literalRe = regexp.MustCompile(`^[A-Za-z0-9_:.$-]*$`)

// RecordSQL returns SQL that records m as applied for component in
// schema's migration table (creating the table if missing), and SQL that
// deletes that record: what [Migrate] does besides m's own SQL, for
// those who apply the rendered migrations with another tool. component and
// m.Name travel as literals, so they are limited to letters, digits and
// _:.$- .
func RecordSQL(schema, component string, m Migration) (up, down string, err error) {
	if err := ident.Validate("schema", schema); err != nil {
		return "", "", err
	}
	if !literalRe.MatchString(component) || !literalRe.MatchString(m.Name) {
		return "", "", fmt.Errorf("migration record: component %q or name %q has characters outside [A-Za-z0-9_:.$-]", component, m.Name)
	}
	t := ident.Quote(schema, Table)
	up = createTableSQL(schema) + ";\n" +
		"INSERT INTO " + t + " (component, version, name) VALUES ('" + component + "', " + strconv.Itoa(m.Version) + ", '" + m.Name + "') ON CONFLICT DO NOTHING;\n"
	down = "DELETE FROM " + t + " WHERE component = '" + component + "' AND version = " + strconv.Itoa(m.Version) + ";\n"
	return up, down, nil
}

// tableExists reports whether schema has a migration table.
func tableExists(ctx context.Context, db Querier, schema string) (bool, error) {
	var exists bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
	JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
	WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p'))`, schema, Table).Scan(&exists)
	return exists, err
}

// Lock takes the per-schema migration lock in tx (released at its end):
// the lock Migrate takes for every version, so work done under it never
// interleaves with a migration of the same schema.
func Lock(ctx context.Context, tx pgx.Tx, schema string) error {
	_, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended('watermill-idempotency/migrate/' || $1, 0))", schema)
	return err
}

// Forget deletes the records of versions of component from schema's
// migration table, in tx: the caller has undone their effect, so [Migrate] must
// apply them again. Without a migration table there is nothing to forget.
func Forget(ctx context.Context, tx pgx.Tx, schema, component string, versions []int) error {
	if err := ident.Validate("schema", schema); err != nil {
		return err
	}
	if len(versions) == 0 {
		return nil
	}
	if exists, err := tableExists(ctx, tx, schema); err != nil || !exists {
		return err
	}
	v32 := make([]int32, len(versions))
	for i, v := range versions {
		v32[i] = int32(v)
	}
	_, err := tx.Exec(ctx, "DELETE FROM "+ident.Quote(schema, Table)+" WHERE component = $1 AND version = ANY($2)", component, v32)
	return err
}

// inTx opens a transaction, takes the per-schema migration lock, ensures the
// bookkeeping table, tells fn whether version is applied, and commits.
func inTx(ctx context.Context, db Beginner, schema, component string, version int, fn func(tx pgx.Tx, isApplied bool) (bool, error)) (done bool, err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	// One lock for the whole schema: concurrent CREATE ... IF NOT EXISTS can
	// still collide in the catalog, so creators must be serialised.
	if err = Lock(ctx, tx, schema); err != nil {
		return false, err
	}
	// CREATE SCHEMA needs CREATE on the database even when the schema
	// exists (IF NOT EXISTS is checked after the privilege): a migration
	// role that owns only its schema (docs/security.md) never runs it.
	var schemaExists bool
	if err = tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)", schema).Scan(&schemaExists); err != nil {
		return false, err
	}
	if !schemaExists {
		if _, err = tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+ident.Quote(schema)); err != nil {
			return false, err
		}
	}
	if _, err = tx.Exec(ctx, createTableSQL(schema)); err != nil {
		return false, err
	}
	var isApplied bool
	if err = tx.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+ident.Quote(schema, Table)+" WHERE component = $1 AND version = $2)", component, version).Scan(&isApplied); err != nil {
		return false, err
	}
	done, err = fn(tx, isApplied)
	if err != nil {
		return false, err
	}
	if err = tx.Commit(ctx); err != nil {
		return false, err
	}
	return done, nil
}

// VersionStatus is one version of a component: applied (with when) or
// pending, or recorded but unknown to the caller's migrations.
type VersionStatus struct {
	Version   int
	Name      string
	Applied   bool
	AppliedAt time.Time
	Unknown   bool
}

// Status compares the versions schema's migration table records for
// component with migs (ascending): each of migs applied or pending, then
// the recorded versions migs does not have (Unknown, with their recorded
// name). Without a migration table every version is pending. It only reads.
func Status(ctx context.Context, db Querier, schema, component string, migs []Migration) ([]VersionStatus, error) {
	if err := ident.Validate("schema", schema); err != nil {
		return nil, err
	}
	var recs []VersionStatus
	exists, err := tableExists(ctx, db, schema)
	if err != nil {
		return nil, err
	}
	if exists {
		rows, err := db.Query(ctx, "SELECT version, name, applied_at FROM "+ident.Quote(schema, Table)+" WHERE component = $1 ORDER BY version", component)
		if err != nil {
			return nil, err
		}
		recs, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (VersionStatus, error) {
			s := VersionStatus{Applied: true}
			var v int32
			err := r.Scan(&v, &s.Name, &s.AppliedAt)
			s.Version = int(v)
			return s, err
		})
		if err != nil {
			return nil, err
		}
	}
	byVersion := make(map[int]VersionStatus, len(recs))
	for _, r := range recs {
		byVersion[r.Version] = r
	}
	out := make([]VersionStatus, 0, len(migs)+len(recs))
	for _, m := range migs {
		s := VersionStatus{Version: m.Version, Name: m.Name}
		if r, ok := byVersion[m.Version]; ok {
			s.Applied, s.AppliedAt = true, r.AppliedAt
			delete(byVersion, m.Version)
		}
		out = append(out, s)
	}
	for _, r := range recs {
		if _, ok := byVersion[r.Version]; ok {
			r.Unknown = true
			out = append(out, r)
		}
	}
	return out, nil
}

// Components returns the components schema's migration table records a
// version of whose names start with prefix, sorted; none without a
// migration table. It only reads.
func Components(ctx context.Context, db Querier, schema, prefix string) ([]string, error) {
	if err := ident.Validate("schema", schema); err != nil {
		return nil, err
	}
	exists, err := tableExists(ctx, db, schema)
	if err != nil || !exists {
		return []string{}, err
	}
	rows, err := db.Query(ctx, "SELECT DISTINCT component FROM "+ident.Quote(schema, Table)+" WHERE starts_with(component, $1) ORDER BY 1", prefix)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
