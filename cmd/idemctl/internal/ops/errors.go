package ops

import (
	"errors"
	"fmt"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// ErrNotFound: the page, group, topic or lease named is not there.
var ErrNotFound = errors.New("not found")

// InputError is bad input: an operation refused it and changed nothing
// (idemctl exits 2, the console answers 404).
type InputError struct{ err error }

func (e *InputError) Error() string { return e.err.Error() }

func (e *InputError) Unwrap() error { return e.err }

// Input returns an *InputError worded as fmt.Errorf.
func Input(format string, args ...any) error {
	return &InputError{err: fmt.Errorf(format, args...)}
}

// IsBadInput reports an *InputError, and the library's errors that mean the
// input named something that is not there or not allowed; nothing was
// changed.
func IsBadInput(err error) bool {
	var ie *InputError
	if errors.As(err, &ie) {
		return true
	}
	for _, target := range []error{
		dedupsql.ErrGroupNotFound, dedupsql.ErrGroupExists,
		outbox.ErrInvalidTopic, outbox.ErrTopicNotMigrated,
		retrytopic.ErrKeyNotParked,
	} {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// MissingTable words a missing table for idemctl's user: which table, and
// the command that creates it.
func MissingTable(err error) error {
	var terr *migrate.TableError
	if errors.As(err, &terr) && errors.Is(terr, deduplicator.ErrTableMissing) && terr.Problem == "does not exist" {
		return fmt.Errorf("table %s does not exist (run idemctl migrate up, or check --schema/--table)", terr.Table)
	}
	if table, ok := pgerr.UndefinedTable(err); ok { // from the operator's statements (internal/dedupsql)
		return fmt.Errorf("table %s does not exist (run idemctl migrate up, or check --schema/--table)", table)
	}
	return err
}
