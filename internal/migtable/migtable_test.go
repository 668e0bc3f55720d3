package migtable_test

import (
	"context"
	"testing"
	"testing/fstest"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemkit/watermill-idempotency/internal/migtable"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type names struct{ Schema, Table string }

var files = fstest.MapFS{
	"001_create.up.sql":   {Data: []byte(`CREATE TABLE {{ident .Schema .Table}} (id int PRIMARY KEY);`)},
	"001_create.down.sql": {Data: []byte(`DROP TABLE {{ident .Schema .Table}};`)},
	"002_column.up.sql":   {Data: []byte(`ALTER TABLE {{ident .Schema .Table}} ADD COLUMN note text;`)},
	"002_column.down.sql": {Data: []byte(`ALTER TABLE {{ident .Schema .Table}} DROP COLUMN note;`)},
	"README.md":           {Data: []byte("not a migration")},
}

func load(t *testing.T, schema string) []migtable.Version {
	t.Helper()
	vs, err := migtable.Load(names{Schema: schema, Table: "thing"}, files)
	require.NoError(t, err)
	return vs
}

func TestLoadRendersAndOrders(t *testing.T) {
	t.Parallel()
	vs := load(t, "s1")
	require.Len(t, vs, 2)
	require.Equal(t, 1, vs[0].Version)
	require.Equal(t, "create", vs[0].Name)
	require.Equal(t, `CREATE TABLE "s1"."thing" (id int PRIMARY KEY);`, vs[0].Up)
	require.Equal(t, `DROP TABLE "s1"."thing";`, vs[0].Down)
	require.Equal(t, 2, vs[1].Version)
}

func TestLoadErrors(t *testing.T) {
	t.Parallel()
	_, err := migtable.Load(names{}, fstest.MapFS{"001_x.down.sql": {Data: []byte("SELECT 1")}})
	require.ErrorContains(t, err, "has no up file")
	_, err = migtable.Load(names{}, fstest.MapFS{"001_x.up.sql": {Data: []byte("{{ident .Nope}}")}})
	require.ErrorContains(t, err, "render 001_x.up.sql")
	_, err = migtable.Load(names{}, fstest.MapFS{"001_x.up.sql": {Data: []byte("{{")}})
	require.ErrorContains(t, err, "parse 001_x.up.sql")
}

// RecordSQL does what a migration does to the migration table; Pending
// lists the versions not recorded, per component (all of them without a
// migration table); Forget makes versions pending again.
func TestRecordPendingAndForget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 2)
	vs := load(t, db.Schema)

	pending, err := migtable.Pending(ctx, db.Pool, db.Schema, "thing:t", vs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, pending, "no migration table: everything is pending")
	require.Zero(t, db.Count(t, "SELECT 1 FROM information_schema.tables WHERE table_schema = $1", db.Schema), "Pending only reads")

	for _, v := range vs {
		up, _, err := migtable.RecordSQL(db.Schema, "thing:t", v)
		require.NoError(t, err)
		db.Exec(t, v.Up+";"+up)
		db.Exec(t, up) // idempotent
	}
	pending, err = migtable.Pending(ctx, db.Pool, db.Schema, "thing:t", vs)
	require.NoError(t, err)
	require.Empty(t, pending)
	pending, err = migtable.Pending(ctx, db.Pool, db.Schema, "other", vs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, pending, "records are per component")
	comps, err := migtable.Components(ctx, db.Pool, db.Schema, "thing:")
	require.NoError(t, err)
	require.Equal(t, []string{"thing:t"}, comps)

	_, down, err := migtable.RecordSQL(db.Schema, "thing:t", vs[1])
	require.NoError(t, err)
	db.Exec(t, vs[1].Down+";"+down)
	pending, err = migtable.Pending(ctx, db.Pool, db.Schema, "thing:t", vs)
	require.NoError(t, err)
	require.Equal(t, []int{2}, pending)

	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, migtable.Lock(ctx, tx, db.Schema))
	require.NoError(t, migtable.Forget(ctx, tx, db.Schema, "thing:t", []int{1}))
	pending, err = migtable.Pending(ctx, tx, db.Schema, "thing:t", vs)
	require.NoError(t, err)
	require.Equal(t, []int{1, 2}, pending)
	require.NoError(t, tx.Commit(ctx))

	_, err = migtable.Pending(ctx, db.Pool, `x"; --`, "thing", vs)
	require.Error(t, err)
	_, _, err = migtable.RecordSQL(db.Schema, "it's", vs[0])
	require.Error(t, err)
	_, _, err = migtable.RecordSQL(`a"b`, "thing", vs[0])
	require.Error(t, err)

	// Without a migration table Forget has nothing to do.
	empty := pgtest.New(t, 1)
	tx, err = empty.Pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, migtable.Forget(ctx, tx, empty.Schema, "thing", []int{1}))
	require.NoError(t, tx.Rollback(ctx))
}
