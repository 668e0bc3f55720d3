package partition

import (
	"context"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Partitioned reports whether the table named by qualified (quoted,
// schema-qualified) exists and whether it is a partitioned table. It only
// reads the catalogs.
func Partitioned(ctx context.Context, db dbx.Querier, qualified string) (exists, partitioned bool, err error) {
	var kind *string
	err = db.QueryRow(ctx, "SELECT (SELECT relkind::text FROM pg_catalog.pg_class WHERE oid = to_regclass($1))", qualified).Scan(&kind)
	if err != nil || kind == nil {
		return false, false, err
	}
	return true, *kind == "p", nil
}
