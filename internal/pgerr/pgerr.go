// Package pgerr tells PostgreSQL errors apart by SQLSTATE, never by their
// text.
package pgerr

import (
	"errors"
	"strings"

	"github.com/jackc/pgerrcode"
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

// UndefinedTable reports whether err is, or wraps, PostgreSQL's "relation
// does not exist" (SQLSTATE 42P01), and the relation it names as the
// statement wrote it (the message is `relation "schema.table" does not
// exist`; the whole message when it has no quoted name).
func UndefinedTable(err error) (table string, ok bool) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != pgerrcode.UndefinedTable {
		return "", false
	}
	table = pgErr.Message
	if _, rest, ok := strings.Cut(pgErr.Message, `"`); ok {
		if name, _, ok := strings.Cut(rest, `"`); ok {
			table = name
		}
	}
	return table, true
}
