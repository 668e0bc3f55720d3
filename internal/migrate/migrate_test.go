package migrate_test

import (
	"context"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/migrate"
	"github.com/idemkit/watermill-idempotency/internal/pgtest"
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

func TestUpIsIdempotentAndDownReverts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	migs := load(t, files, db.Schema)

	applied, err := migrate.Up(ctx, db.Pool, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied)
	applied, err = migrate.Up(ctx, db.Pool, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Empty(t, applied, "a second Up applies nothing")
	db.Exec(t, "INSERT INTO thing (id, note) VALUES (1, 'x')")
	require.Equal(t, 2, db.Count(t, "SELECT 1 FROM idem_schema_migration WHERE component = 'thing'"))

	reverted, err := migrate.Down(ctx, db.Pool, db.Schema, "thing", migs, 1)
	require.NoError(t, err)
	require.Equal(t, []int{2}, reverted)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'thing' AND column_name = 'note'", db.Schema))

	reverted, err = migrate.Down(ctx, db.Pool, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	require.Equal(t, []int{1}, reverted)
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'thing'", db.Schema))
	require.Zero(t, db.Count(t, "SELECT 1 FROM idem_schema_migration"))

	reverted, err = migrate.Down(ctx, db.Pool, db.Schema, "thing", migs, 0)
	require.NoError(t, err)
	require.Empty(t, reverted, "nothing left to revert")

	applied, err = migrate.Up(ctx, db.Pool, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, applied, "up again after down")
}

// A failing version rolls back alone: earlier versions stay applied, the
// failing one leaves neither partial DDL nor a bookkeeping row.
func TestFailingVersionRollsBackItsTransactionOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	bad := fstest.MapFS{
		"001_create.up.sql": files["001_create.up.sql"],
		"002_broken.up.sql": {Data: []byte(`CREATE TABLE {{ident .Schema "partial"}} (id int); SELECT no_such_function();`)},
	}
	applied, err := migrate.Up(ctx, db.Pool, db.Schema, "thing", load(t, bad, db.Schema))
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
		wg.Go(func() { results[i], errs[i] = migrate.Up(ctx, db.Pool, db.Schema, "thing", migs) })
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
		_, err := migrate.Up(context.Background(), db.Pool, s, "thing", nil)
		require.Error(t, err, "%q", s)
		_, err = migrate.Down(context.Background(), db.Pool, s, "thing", nil, 0)
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

	_, err = migrate.Up(ctx, db.Pool, db.Schema, "thing", migs[:1])
	require.NoError(t, err)
	pending, err = migrate.Pending(ctx, db.Pool, db.Schema, "thing", migs)
	require.NoError(t, err)
	require.Equal(t, []int{2}, pending)
	pending, err = migrate.Pending(ctx, db.Pool, db.Schema, "other", migs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, pending, "records are per component")

	_, err = migrate.Up(ctx, db.Pool, db.Schema, "thing", migs)
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
	applied, err := migrate.Up(ctx, db.Pool, db.Schema, "thing:t", migs)
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
