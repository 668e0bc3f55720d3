package deduplicator

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// groupNameError says why a name is refused: "<field>: <name quoted, cut
// to 80 bytes> <problem>". It unwraps to [ErrInvalidGroupName].
type groupNameError struct{ msg string }

func (e *groupNameError) Error() string { return e.msg }
func (e *groupNameError) Unwrap() error { return ErrInvalidGroupName }

func refuseGroupName(field, name, problem string) error {
	return &groupNameError{msg: field + ": " + quoteName(name) + " " + problem}
}

// ValidateGroupName refuses a consumer group name (or another name stored
// with a group, such as its Idempotency-Key namespace) that PostgreSQL
// cannot store: one containing a NUL byte (no text value can hold it) or bytes that
// are not valid UTF-8 (the client encoding the library uses). Every Config
// and function taking a group name calls it, so a bad name fails at
// Validate with an error wrapping [ErrInvalidGroupName] (naming field and
// the name) instead of later with SQLSTATE 22021.
// The empty name is not checked here (each caller says why it needs one). A
// character valid in UTF-8 that a database with another server encoding
// cannot represent is found by the server: [Deduplicator.Register] returns
// it wrapping ErrInvalidGroupName too. field names the configuration field or
// argument in the error.
func ValidateGroupName(field, name string) error {
	switch {
	case strings.IndexByte(name, 0) >= 0:
		return refuseGroupName(field, name, "contains a NUL byte, which PostgreSQL cannot store in text")
	case !utf8.ValidString(name):
		return refuseGroupName(field, name, "is not valid UTF-8, which PostgreSQL cannot store in text")
	}
	return nil
}

func quoteName(name string) string {
	if len(name) > 80 {
		return fmt.Sprintf("%q…", name[:80])
	}
	return fmt.Sprintf("%q", name)
}

// groupNameRefused turns the server's refusal to store a group name
// (SQLSTATE 22021 character_not_in_repertoire: NUL or invalid UTF-8;
// 22P05 untranslatable_character: not representable in the server's
// encoding) into an error wrapping ErrInvalidGroupName; other errors are
// returned unchanged.
func groupNameRefused(field, name string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.CharacterNotInRepertoire || pgErr.Code == pgerrcode.UntranslatableCharacter) {
		return refuseGroupName(field, name, "is refused by the database (SQLSTATE "+pgErr.Code+": "+pgErr.Message+")")
	}
	return err
}
