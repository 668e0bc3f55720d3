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
