package migrate_test

import (
	"context"
	"errors"
	"fmt"
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

func load(t *testing.T, fsys fstest.MapFS, schema string) []migrate.Migration {
	t.Helper()
	migs, err := migrate.Load(fsys, names{Schema: schema, Table: "thing"})
	require.NoError(t, err)
	return migs
}

func TestLoadRendersAndOrders(t *testing.T) {
	t.Parallel()
	migs := load(t, files, "s1")
	require.Len(t, migs, 2)
	require.Equal(t, 1, migs[0].Version)
	require.Equal(t, "create", migs[0].Name)
	require.Equal(t, `CREATE TABLE "s1"."thing" (id int PRIMARY KEY);`, migs[0].Up)
	require.Equal(t, `DROP TABLE "s1"."thing";`, migs[0].Down)
	require.Equal(t, 2, migs[1].Version)
}

func TestLoadErrors(t *testing.T) {
	t.Parallel()
	_, err := migrate.Load(fstest.MapFS{"001_x.down.sql": {Data: []byte("SELECT 1")}}, names{})
	require.ErrorContains(t, err, "has no up file")
	_, err = migrate.Load(fstest.MapFS{"001_x.up.sql": {Data: []byte("{{ident .Nope}}")}}, names{})
	require.ErrorContains(t, err, "render 001_x.up.sql")
	_, err = migrate.Load(fstest.MapFS{"001_x.up.sql": {Data: []byte("{{")}}, names{})
	require.ErrorContains(t, err, "parse 001_x.up.sql")
}

// up and down run Migrate on one line and return the versions it stepped.
func up(t *testing.T, db migrate.Beginner, schema, component string, migs []migrate.Migration, target int) ([]int, error) {
	t.Helper()
	steps, err := migrate.Migrate(context.Background(), db, schema, migrate.DirectionUp, []migrate.Line{{Component: component, Migrations: migs}}, migrate.Options{TargetVersion: target})
	return versions(t, component, steps), err
}

func down(t *testing.T, db migrate.Beginner, schema, component string, migs []migrate.Migration, target int) ([]int, error) {
	t.Helper()
	steps, err := migrate.Migrate(context.Background(), db, schema, migrate.DirectionDown, []migrate.Line{{Component: component, Migrations: migs}}, migrate.Options{TargetVersion: target})
	return versions(t, component, steps), err
}

func versions(t *testing.T, component string, steps []migrate.Step) []int {
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
	migs := load(t, files, db.Schema)

	applied, err := up(t, db.Pool, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied)
	applied, err = up(t, db.Pool, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	require.Empty(t, applied, "a second up applies nothing")
	db.Exec(t, "INSERT INTO thing (id, note) VALUES (1, 'x')")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM idem_schema_migration WHERE component = 'thing'"))

	reverted, err := down(t, db.Pool, db.Schema, "thing", migs, 1)
	require.NoError(t, err)
	require.Equal(t, []int{2}, reverted)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'thing' AND column_name = 'note'", db.Schema))

	reverted, err = down(t, db.Pool, db.Schema, "thing", migs, -1)
	require.NoError(t, err)
	require.Equal(t, []int{1}, reverted)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'thing'", db.Schema))
	require.Zero(t, db.Count(t, "SELECT 1 FROM idem_schema_migration"))

	reverted, err = down(t, db.Pool, db.Schema, "thing", migs, -1)
	require.NoError(t, err)
	require.Empty(t, reverted, "nothing left to revert")

	applied, err = up(t, db.Pool, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied, "up again after down")
}

// A target version bounds both directions; going down without one reverts
// one version only (as rivermigrate does), and every line steps on its own.
func TestTargetVersionAndOneStepDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	lines := []migrate.Line{
		{Component: "a", Migrations: load(t, files, db.Schema)},
		{Component: "b", Migrations: loadAs(t, files, db.Schema, "other")},
	}
	steps, err := migrate.Migrate(ctx, db.Pool, db.Schema, migrate.DirectionUp, lines, migrate.Options{TargetVersion: 1})
	require.NoError(t, err)
	require.Equal(t, []string{"a 1", "b 1"}, stepNames(steps))
	steps, err = migrate.Migrate(ctx, db.Pool, db.Schema, migrate.DirectionUp, lines, migrate.Options{})
	require.NoError(t, err)
	require.Equal(t, []string{"a 2", "b 2"}, stepNames(steps))

	steps, err = migrate.Migrate(ctx, db.Pool, db.Schema, migrate.DirectionDown, lines, migrate.Options{})
	require.NoError(t, err)
	require.Equal(t, []string{"b 2", "a 2"}, stepNames(steps), "down goes backwards, one version per line")
	steps, err = migrate.Migrate(ctx, db.Pool, db.Schema, migrate.DirectionDown, lines, migrate.Options{})
	require.NoError(t, err)
	require.Equal(t, []string{"b 1", "a 1"}, stepNames(steps))
	steps, err = migrate.Migrate(ctx, db.Pool, db.Schema, migrate.DirectionDown, lines, migrate.Options{})
	require.NoError(t, err)
	require.Empty(t, steps)

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
		_, err := migrate.Migrate(ctx, db.Pool, db.Schema, tc.dir, lines, migrate.Options{TargetVersion: tc.target})
		require.ErrorContains(t, err, tc.msg)
	}
}

// Going down refuses a line whose migration table records a version the
// line does not know: reverting the known ones could drop what it needs.
func TestDownRefusesUnknownRecordedVersion(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 2)
	migs := load(t, files, db.Schema)
	_, err := up(t, db.Pool, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	db.Exec(t, "INSERT INTO idem_schema_migration (component, version, name) VALUES ('thing', 100, 'newer')")
	reverted, err := down(t, db.Pool, db.Schema, "thing", migs, -1)
	require.ErrorIs(t, err, migrate.ErrUnknownVersion)
	require.Empty(t, reverted)
	require.Equal(t, 3, db.Count(t, "SELECT 1 FROM idem_schema_migration"))
	reverted, err = down(t, db.Pool, db.Schema, "thing", migs, 2)
	require.ErrorIs(t, err, migrate.ErrUnknownVersion, "100 is above the target")
	require.Empty(t, reverted)
}

// Verify runs in the version's transaction: an error rolls the version back
// (its SQL and its record), which is how existing tables are adopted only
// when their shape matches.
func TestVerifyRollsBackTheVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	refuse := errors.New("wrong shape")
	line := migrate.Line{Component: "thing", Migrations: load(t, files, db.Schema)[:1], Verify: func(ctx context.Context, tx pgx.Tx, m migrate.Migration) error {
		require.Equal(t, 1, m.Version)
		var n int
		require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM thing").Scan(&n))
		return refuse
	}}
	steps, err := migrate.Migrate(ctx, db.Pool, db.Schema, migrate.DirectionUp, []migrate.Line{line}, migrate.Options{})
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
	migs := load(t, files, db.Schema)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	applied, err := up(t, tx, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied)
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema))
}

func stepNames(steps []migrate.Step) []string {
	out := make([]string, len(steps))
	for i, s := range steps {
		out[i] = fmt.Sprintf("%s %d", s.Component, s.Version)
	}
	return out
}

func loadAs(t *testing.T, fsys fstest.MapFS, schema, table string) []migrate.Migration {
	t.Helper()
	migs, err := migrate.Load(fsys, names{Schema: schema, Table: table})
	require.NoError(t, err)
	return migs
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
	applied, err := up(t, db.Pool, db.Schema, "thing", load(t, bad, db.Schema), 0)
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
	migs := load(t, files, db.Schema)

	var wg sync.WaitGroup
	results := make([][]int, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Go(func() {
			steps, err := migrate.Migrate(ctx, db.Pool, db.Schema, migrate.DirectionUp, []migrate.Line{{Component: "thing", Migrations: migs}}, migrate.Options{})
			results[i], errs[i] = make([]int, len(steps)), err
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
		_, err := up(t, db.Pool, s, "thing", nil, 0)
		require.Error(t, err, "%q", s)
		_, err = down(t, db.Pool, s, "thing", nil, 0)
		require.Error(t, err, "%q", s)
	}
}

// Pending lists the versions not recorded for the component, in order; a
// schema without a migration table has every version pending. Forget makes
// versions pending again.
func TestPendingAndForget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	migs := load(t, files, db.Schema)

	pending, err := migrate.Pending(ctx, db.Pool, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, pending, "no migration table: everything is pending")
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "Pending only reads")

	_, err = up(t, db.Pool, db.Schema, "thing", migs, 1)
	require.NoError(t, err)
	pending, err = migrate.Pending(ctx, db.Pool, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Equal(t, []int{2}, pending)
	pending, err = migrate.Pending(ctx, db.Pool, db.Schema, "other", migs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, pending, "records are per component")

	_, err = up(t, db.Pool, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	pending, err = migrate.Pending(ctx, db.Pool, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Empty(t, pending)

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, migrate.Lock(ctx, tx, db.Schema))
	require.NoError(t, migrate.Forget(ctx, tx, db.Schema, "thing", []int{2}))
	pending, err = migrate.Pending(ctx, tx, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Equal(t, []int{2}, pending)
	require.NoError(t, tx.Commit(ctx))

	_, err = migrate.Pending(ctx, db.Pool, `x"; --`, "thing", migs)
	require.Error(t, err)

	// Without a migration table Forget has nothing to do.
	empty := pgtest.New(t, 1)
	tx, err = empty.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, migrate.Forget(ctx, tx, empty.Schema, "thing", []int{1}))
	require.NoError(t, tx.Rollback(ctx))
}

// RecordSQL does what Up and Down do to the migration table, for another
// tool; it refuses names that cannot travel as literals.
func TestRecordSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	migs := load(t, files, db.Schema)
	for _, m := range migs {
		up, _, err := migrate.RecordSQL(db.Schema, "thing:t", m)
		require.NoError(t, err)
		db.Exec(t, m.Up+";"+up)
		db.Exec(t, up) // idempotent
	}
	pending, err := migrate.Pending(ctx, db.Pool, db.Schema, "thing:t", migs)
	require.NoError(t, err)
	require.Empty(t, pending)
	applied, err := up(t, db.Pool, db.Schema, "thing:t", migs, 0)
	require.NoError(t, err)
	require.Empty(t, applied)
	_, down, err := migrate.RecordSQL(db.Schema, "thing:t", migs[1])
	require.NoError(t, err)
	db.Exec(t, migs[1].Down+";"+down)
	pending, err = migrate.Pending(ctx, db.Pool, db.Schema, "thing:t", migs)
	require.NoError(t, err)
	require.Equal(t, []int{2}, pending)

	_, _, err = migrate.RecordSQL(db.Schema, "it's", migs[0])
	require.Error(t, err)
	_, _, err = migrate.RecordSQL(`a"b`, "thing", migs[0])
	require.Error(t, err)
}
