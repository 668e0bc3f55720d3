// Package pgerr tells PostgreSQL errors apart by SQLSTATE, never by their
// text.
package pgerr

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// Has reports whether err is, or wraps, a PostgreSQL error whose SQLSTATE
// is one of codes (pgerrcode's constants).
func Has(err error, codes ...string) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	for _, c := range codes {
		if pgErr.Code == c {
			return true
		}
	}
	return false
}
