package pgerr_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/internal/pgerr"
)

func TestHas(t *testing.T) {
	err := fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: pgerrcode.LockNotAvailable, Message: "any text"})
	if !pgerr.Has(err, pgerrcode.DeadlockDetected, pgerrcode.LockNotAvailable) {
		t.Fatal("a wrapped error of one of the codes")
	}
	if pgerr.Has(err, pgerrcode.DeadlockDetected) {
		t.Fatal("another code")
	}
	if pgerr.Has(errors.New("55P03"), pgerrcode.LockNotAvailable) {
		t.Fatal("not a PostgreSQL error, whatever its text")
	}
	if pgerr.Has(nil, pgerrcode.LockNotAvailable) {
		t.Fatal("nil")
	}
}

func TestUndefinedTable(t *testing.T) {
	err := fmt.Errorf("read: %w", &pgconn.PgError{Code: pgerrcode.UndefinedTable, Message: `relation "s.processed_event_group" does not exist`})
	if table, ok := pgerr.UndefinedTable(err); !ok || table != "s.processed_event_group" {
		t.Fatalf("got %q, %v: want the relation the message names", table, ok)
	}
	if table, ok := pgerr.UndefinedTable(&pgconn.PgError{Code: pgerrcode.UndefinedTable, Message: "no quotes"}); !ok || table != "no quotes" {
		t.Fatalf("got %q, %v: want the whole message", table, ok)
	}
	if _, ok := pgerr.UndefinedTable(&pgconn.PgError{Code: pgerrcode.UndefinedColumn, Message: `column "x" does not exist`}); ok {
		t.Fatal("another code")
	}
	if _, ok := pgerr.UndefinedTable(errors.New(`relation "t" does not exist`)); ok {
		t.Fatal("text alone is not a SQLSTATE")
	}
}
