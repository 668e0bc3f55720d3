package retrytopic

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/idemkit/watermill-idempotency/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// component is the name the parked-keys migrations are recorded under in
// the library's migration table, with the table name after a colon.
const component = "retry_parked_key"

func componentKey(t ParkedKeysTable) string { return component + ":" + t.Table }

// MigrationLine returns the migration line of the parked-keys table t of
// [KeyOrder], for a migrate.Migrator: its versions are recorded under the
// component retry_parked_key:<table>. [New] refuses a table whose versions
// are not all recorded (migrate.ErrMigrationsPending). An invalid t is returned by
// migrate.New.
func MigrationLine(t ParkedKeysTable) migrate.Line {
	t.setDefaults()
	if err := t.validate(); err != nil {
		return migrate.Line{Component: componentKey(t), Err: fmt.Errorf("retrytopic: invalid config: %w", err)}
	}
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err)
	}
	return migrate.Line{
		Component: componentKey(t),
		Schema:    t.Schema,
		Templates: []fs.FS{sub},
		Data:      struct{ Schema, Table string }{t.Schema, t.Table},
	}
}

// checkMigrated refuses a parked-keys table with pending migrations.
func checkMigrated(ctx context.Context, db migrate.Beginner, t ParkedKeysTable) error {
	m, err := migrate.New(db, MigrationLine(t))
	if err != nil {
		return err
	}
	res, err := m.Validate(ctx)
	if err != nil {
		return fmt.Errorf("retrytopic: %w", err)
	}
	if !res.OK {
		versions := make([]int, len(res.Pending))
		for i, p := range res.Pending {
			versions[i] = p.Version
		}
		return &migrate.TableError{Component: "retrytopic", Table: t.Schema + "." + t.Table, Err: migrate.ErrMigrationsPending,
			Problem: fmt.Sprintf("the parked-keys table has pending versions %v", versions),
			Fix:     "migrate retrytopic.MigrationLine(table) up at start-up (a migrate.Migrator, or its rendered Migrations in your migration tool)"}
	}
	return nil
}
