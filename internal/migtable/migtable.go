// Package migtable holds what the migrate package and the components
// share about migrations: the migration table (idem_schema_migration) every
// component records its versions in, its lock, its reads and deletes, and
// the loading of NNN_name.up.sql / NNN_name.down.sql templates.
package migtable

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"text/template"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// Table is the migration table, created in the schema of the tables it
// records.
const Table = "idem_schema_migration"

// CreateSQL creates schema's migration table if it is missing.
func CreateSQL(schema string) string {
	return `CREATE TABLE IF NOT EXISTS ` + ident.Quote(schema, Table) + ` (
	component  text        NOT NULL,
	version    integer     NOT NULL,
	name       text        NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (component, version)
)`
}

// Exists reports whether schema has a migration table.
func Exists(ctx context.Context, db dbx.Querier, schema string) (bool, error) {
	var exists bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c
	JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
	WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p'))`, schema, Table).Scan(&exists)
	return exists, err
}

// Lock takes the per-schema migration lock in tx (released at its end):
// every version of every migration takes it, so work done under it never
// interleaves with a migration of the same schema.
func Lock(ctx context.Context, tx pgx.Tx, schema string) error {
	_, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended('watermill-idempotency/migrate/' || $1, 0))", schema)
	return err
}

// Recorded returns the versions schema's migration table records for
// component; none without a migration table.
func Recorded(ctx context.Context, db dbx.Querier, schema, component string) (map[int]bool, error) {
	recorded := map[int]bool{}
	exists, err := Exists(ctx, db, schema)
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

// Forget deletes the records of versions of component from schema's
// migration table, in tx: the caller has undone their effect, so a
// migration must apply them again. Without a migration table there is
// nothing to forget.
func Forget(ctx context.Context, tx pgx.Tx, schema, component string, versions []int) error {
	if err := ident.Validate("schema", schema); err != nil {
		return err
	}
	if len(versions) == 0 {
		return nil
	}
	if exists, err := Exists(ctx, tx, schema); err != nil || !exists {
		return err
	}
	v32 := make([]int32, len(versions))
	for i, v := range versions {
		v32[i] = int32(v)
	}
	_, err := tx.Exec(ctx, "DELETE FROM "+ident.Quote(schema, Table)+" WHERE component = $1 AND version = ANY($2)", component, v32)
	return err
}

// Components returns the components schema's migration table records a
// version of whose names start with prefix, sorted; none without a
// migration table. It only reads.
func Components(ctx context.Context, db dbx.Querier, schema, prefix string) ([]string, error) {
	if err := ident.Validate("schema", schema); err != nil {
		return nil, err
	}
	exists, err := Exists(ctx, db, schema)
	if err != nil || !exists {
		return []string{}, err
	}
	rows, err := db.Query(ctx, "SELECT DISTINCT component FROM "+ident.Quote(schema, Table)+" WHERE starts_with(component, $1) ORDER BY 1", prefix)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// Version is one migration version rendered for its tables.
type Version struct {
	Version int
	Name    string
	Up      string
	Down    string
}

var fileRe = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// Load reads NNN_name.up.sql / NNN_name.down.sql templates from the root
// of each of fss and renders each with data, oldest version first.
// Templates may call {{ident "a" "b"}} to quote identifiers.
func Load(data any, fss ...fs.FS) ([]Version, error) {
	byVersion := map[int]*Version{}
	for _, fsys := range fss {
		entries, err := fs.ReadDir(fsys, ".")
		if err != nil {
			return nil, err
		}
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
				mig = &Version{Version: v, Name: m[2]}
				byVersion[v] = mig
			}
			if m[3] == "up" {
				mig.Up = buf.String()
			} else {
				mig.Down = buf.String()
			}
		}
	}
	out := make([]Version, 0, len(byVersion))
	for _, m := range byVersion {
		if m.Up == "" {
			return nil, fmt.Errorf("migration %d_%s has no up file", m.Version, m.Name)
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Pending returns the versions of vs (in their order) that schema's
// migration table does not record for component; every version without a
// migration table. It only reads.
func Pending(ctx context.Context, db dbx.Querier, schema, component string, vs []Version) ([]int, error) {
	if err := ident.Validate("schema", schema); err != nil {
		return nil, err
	}
	recorded, err := Recorded(ctx, db, schema, component)
	if err != nil {
		return nil, fmt.Errorf("pending migrations of %s: %w", component, err)
	}
	var pending []int
	for _, v := range vs {
		if !recorded[v.Version] {
			pending = append(pending, v.Version)
		}
	}
	return pending, nil
}

var literalRe = regexp.MustCompile(`^[A-Za-z0-9_:.$-]*$`)

// RecordSQL returns SQL that records v as applied for component in
// schema's migration table (creating the table if missing), and SQL that
// deletes that record: what a migration does besides v's own SQL, for
// those who apply the rendered migrations with another tool. component and
// v.Name travel as literals, so they are limited to letters, digits and
// _:.$- .
func RecordSQL(schema, component string, v Version) (up, down string, err error) {
	if err := ident.Validate("schema", schema); err != nil {
		return "", "", err
	}
	if err := ValidComponent(component); err != nil {
		return "", "", err
	}
	if !literalRe.MatchString(v.Name) {
		return "", "", fmt.Errorf("migration record: name %q has characters outside [A-Za-z0-9_:.$-]", v.Name)
	}
	t := ident.Quote(schema, Table)
	up = CreateSQL(schema) + ";\n" +
		"INSERT INTO " + t + " (component, version, name) VALUES ('" + component + "', " + strconv.Itoa(v.Version) + ", '" + v.Name + "') ON CONFLICT DO NOTHING;\n"
	down = "DELETE FROM " + t + " WHERE component = '" + component + "' AND version = " + strconv.Itoa(v.Version) + ";\n"
	return up, down, nil
}

// ValidComponent refuses a component name that cannot travel as a SQL
// literal: empty, or with characters outside [A-Za-z0-9_:.$-].
func ValidComponent(component string) error {
	if component == "" || !literalRe.MatchString(component) {
		return fmt.Errorf("migration component %q: want letters, digits and _:.$- only", component)
	}
	return nil
}
