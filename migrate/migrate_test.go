package migrate_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

type names struct{ Schema, Table string }

var files = fstest.MapFS{
	"001_create.up.sql":   {Data: []byte(`CREATE TABLE {{ident .Schema .Table}} (id int PRIMARY KEY);`)},
	"001_create.down.sql": {Data: []byte(`DROP TABLE {{ident .Schema .Table}};`)},
	"002_column.up.sql":   {Data: []byte(`ALTER TABLE {{ident .Schema .Table}} ADD COLUMN note text;`)},
	"002_column.down.sql": {Data: []byte(`ALTER TABLE {{ident .Schema .Table}} DROP COLUMN note;`)},
	"README.md":           {Data: []byte("not a migration")},
}

// thing is the line of table thing in schema, from fsys.
func thing(schema string, fsys fstest.MapFS) migrate.Line {
	return migrate.Line{Component: "thing", Schema: schema, Templates: []fs.FS{fsys}, Data: names{Schema: schema, Table: "thing"}}
}

// run migrates line in dir and returns the versions it stepped.
func run(t *testing.T, db migrate.Beginner, line migrate.Line, dir migrate.Direction, target int) ([]int, error) {
	t.Helper()
	m, err := migrate.New(db, line)
	if err != nil {
		return nil, err
	}
	res, err := m.Migrate(context.Background(), dir, &migrate.MigrateOpts{TargetVersion: target})
	return versions(t, line.Component, res.Versions), err
}

func up(t *testing.T, db migrate.Beginner, line migrate.Line, target int) ([]int, error) {
	t.Helper()
	return run(t, db, line, migrate.DirectionUp, target)
}

func down(t *testing.T, db migrate.Beginner, line migrate.Line, target int) ([]int, error) {
	t.Helper()
	return run(t, db, line, migrate.DirectionDown, target)
}

func versions(t *testing.T, component string, steps []migrate.MigrateVersion) []int {
	t.Helper()
	var vs []int
	for _, s := range steps {
		require.Equal(t, component, s.Component)
		require.NotEmpty(t, s.Name)
		vs = append(vs, s.Version)
	}
	return vs
}

func TestUpIsIdempotentAndDownReverts(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	migs := thing(db.Schema, files)

	applied, err := up(t, db.Pool, migs, 0)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied)
	applied, err = up(t, db.Pool, migs, 0)
	require.NoError(t, err)
	require.Empty(t, applied, "a second up applies nothing")
	db.Exec(t, "INSERT INTO thing (id, note) VALUES (1, 'x')")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM idem_schema_migration WHERE component = 'thing'"))

	reverted, err := down(t, db.Pool, migs, 1)
	require.NoError(t, err)
	require.Equal(t, []int{2}, reverted)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'thing' AND column_name = 'note'", db.Schema))

	reverted, err = down(t, db.Pool, migs, -1)
	require.NoError(t, err)
	require.Equal(t, []int{1}, reverted)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'thing'", db.Schema))
	require.Zero(t, db.Count(t, "SELECT 1 FROM idem_schema_migration"))

	reverted, err = down(t, db.Pool, migs, -1)
	require.NoError(t, err)
	require.Empty(t, reverted, "nothing left to revert")

	applied, err = up(t, db.Pool, migs, 0)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied, "up again after down")
}

// A target version bounds both directions; going down without one reverts
// one version only (as rivermigrate does), and every line steps on its own.
func TestTargetVersionAndOneStepDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	a := thing(db.Schema, files)
	a.Component = "a"
	b := migrate.Line{Component: "b", Schema: db.Schema, Templates: []fs.FS{files}, Data: names{Schema: db.Schema, Table: "other"}}
	m, err := migrate.New(db.Pool, a, b)
	require.NoError(t, err)
	steps, err := m.Migrate(ctx, migrate.DirectionUp, &migrate.MigrateOpts{TargetVersion: 1})
	require.NoError(t, err)
	require.Equal(t, []string{"a 1", "b 1"}, stepNames(steps.Versions))
	steps, err = m.Migrate(ctx, migrate.DirectionUp, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"a 2", "b 2"}, stepNames(steps.Versions))

	steps, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"b 2", "a 2"}, stepNames(steps.Versions), "down goes backwards, one version per line")
	steps, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Equal(t, []string{"b 1", "a 1"}, stepNames(steps.Versions))
	steps, err = m.Migrate(ctx, migrate.DirectionDown, nil)
	require.NoError(t, err)
	require.Empty(t, steps.Versions)

	for _, tc := range []struct {
		dir    migrate.Direction
		target int
		msg    string
	}{
		{migrate.DirectionUp, 3, "target version 3 is not a version of a"},
		{migrate.DirectionUp, -1, "going up"},
		{migrate.DirectionDown, -2, "going down"},
		{"sideways", 0, `direction "sideways"`},
	} {
		_, err := m.Migrate(ctx, tc.dir, &migrate.MigrateOpts{TargetVersion: tc.target})
		require.ErrorContains(t, err, tc.msg)
	}
}

// Going down refuses a line whose migration table records a version the
// line does not know: reverting the known ones could drop what it needs.
func TestDownRefusesUnknownRecordedVersion(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	migs := thing(db.Schema, files)
	_, err := up(t, db.Pool, migs, 0)
	require.NoError(t, err)
	db.Exec(t, "INSERT INTO idem_schema_migration (component, version, name) VALUES ('thing', 100, 'newer')")
	reverted, err := down(t, db.Pool, migs, -1)
	require.ErrorIs(t, err, migrate.ErrUnknownVersion)
	require.Empty(t, reverted)
	require.Equal(t, 3, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
	reverted, err = down(t, db.Pool, migs, 2)
	require.ErrorIs(t, err, migrate.ErrUnknownVersion, "100 is above the target")
	require.Empty(t, reverted)
}

// Verify runs in the version's transaction: an error rolls the version back
// (its SQL and its record), which is how existing tables are adopted only
// when their shape matches.
func TestVerifyRollsBackTheVersion(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	refuse := errors.New("wrong shape")
	line := thing(db.Schema, fstest.MapFS{"001_create.up.sql": files["001_create.up.sql"]})
	line.VerifyFunc = func(ctx context.Context, tx pgx.Tx, version int) error {
		require.Equal(t, 1, version)
		var n int
		require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM thing").Scan(&n))
		return refuse
	}
	steps, err := up(t, db.Pool, line, 0)
	require.ErrorIs(t, err, refuse)
	require.Empty(t, steps)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "neither thing nor a record")
}

// On a caller's transaction every version runs in a savepoint and nothing
// is visible, or kept, unless the caller commits.
func TestMigrateOnACallersTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	applied, err := up(t, tx, thing(db.Schema, files), 0)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied)
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema))
}

func stepNames(steps []migrate.MigrateVersion) []string {
	out := make([]string, len(steps))
	for i, s := range steps {
		out[i] = fmt.Sprintf("%s %d", s.Component, s.Version)
	}
	return out
}

// A failing version rolls back alone: earlier versions stay applied, the
// failing one leaves neither partial DDL nor a bookkeeping row.
func TestFailingVersionRollsBackItsTransactionOnly(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	bad := fstest.MapFS{
		"001_create.up.sql": files["001_create.up.sql"],
		"002_broken.up.sql": {Data: []byte(`CREATE TABLE {{ident .Schema "partial"}} (id int); SELECT no_such_function();`)},
	}
	applied, err := up(t, db.Pool, thing(db.Schema, bad), 0)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, pgerrcode.UndefinedFunction, pgErr.Code)
	require.ErrorContains(t, err, "migration thing 2_broken")
	require.Equal(t, []int{1}, applied)
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'partial'", db.Schema))
}

func TestConcurrentUpAppliesEachVersionOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 8)
	m, err := migrate.New(db.Pool, thing(db.Schema, files))
	require.NoError(t, err)

	var wg sync.WaitGroup
	results := make([][]int, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Go(func() {
			res, err := m.Migrate(ctx, migrate.DirectionUp, nil)
			results[i], errs[i] = make([]int, len(res.Versions)), err
		})
	}
	wg.Wait()
	total := 0
	for i := range 4 {
		require.NoError(t, errs[i])
		total += len(results[i])
	}
	require.Equal(t, 2, total, "each version applied by exactly one caller")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
}

func TestUpRefusesInvalidSchema(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 1)
	for _, s := range []string{"", `x"; DROP SCHEMA public CASCADE; --`, "a b", "1abc"} {
		_, err := migrate.New(db.Pool, thing(s, files))
		require.Error(t, err, "%q", s)
	}
}

// Validate lists what is pending without changing anything, Status every
// version, and Migrations renders SQL that records its version: applying it
// by hand leaves nothing for the Migrator to do.
func TestValidateStatusAndMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	m, err := migrate.New(db.Pool, thing(db.Schema, files))
	require.NoError(t, err)
	res, err := m.Validate(ctx)
	require.NoError(t, err)
	require.False(t, res.OK)
	require.Len(t, res.Pending, 2)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "Validate only reads")

	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, []migrate.MigrationStatus{
		{Component: "thing", Version: 1, Name: "create"},
		{Component: "thing", Version: 2, Name: "column"},
	}, st)

	render, err := migrate.New(nil, thing(db.Schema, files))
	require.NoError(t, err)
	migs, err := render.Migrations()
	require.NoError(t, err)
	require.Equal(t, res.Pending, migs)
	for _, mg := range migs {
		db.Exec(t, mg.Up)
		db.Exec(t, mg.Up[strings.Index(mg.Up, "-- Recorded"):]) // the record is idempotent
	}
	res, err = m.Validate(ctx)
	require.NoError(t, err)
	require.True(t, res.OK)
	applied, err := up(t, db.Pool, thing(db.Schema, files), 0)
	require.NoError(t, err)
	require.Empty(t, applied)
	db.Exec(t, migs[1].Down)
	res, err = m.Validate(ctx)
	require.NoError(t, err)
	require.Equal(t, []migrate.Migration{migs[1]}, res.Pending)

	_, err = render.Migrate(ctx, migrate.DirectionUp, nil)
	require.Error(t, err, "a Migrator without db only renders")
}

// New refuses what it cannot render or record.
func TestNewRefusesBadLines(t *testing.T) {
	t.Parallel()
	lineErr := errors.New("bad config")
	for name, l := range map[string]migrate.Line{
		"Err":              {Err: lineErr},
		"component quote":  {Component: "it's", Schema: "s", Templates: []fs.FS{files}, Data: names{"s", "t"}},
		"no version":       {Component: "x", Schema: "s", Templates: []fs.FS{fstest.MapFS{}}},
		"no up file":       {Component: "x", Schema: "s", Templates: []fs.FS{fstest.MapFS{"001_x.down.sql": {Data: []byte("SELECT 1")}}}},
		"unknown variable": {Component: "x", Schema: "s", Templates: []fs.FS{fstest.MapFS{"001_x.up.sql": {Data: []byte("{{ident .Nope}}")}}}, Data: names{}},
		"template syntax":  {Component: "x", Schema: "s", Templates: []fs.FS{fstest.MapFS{"001_x.up.sql": {Data: []byte("{{")}}}},
	} {
		_, err := migrate.New(nil, l)
		require.Error(t, err, name)
	}
	_, err := migrate.New(nil, migrate.Line{Err: lineErr})
	require.ErrorIs(t, err, lineErr)
	twice := thing("s", files)
	_, err = migrate.New(nil, twice, twice)
	require.ErrorContains(t, err, "given twice")
}
