package deduplicator

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
)

// GroupNameError says why a consumer group name is refused. It wraps
// [ErrInvalidGroupName].
type GroupNameError struct {
	// Field is the configuration field or argument that holds the name
	// (ConsumerGroup, KeyOrder.ConsumerGroup, IdempotencyNamespace, ...).
	Field string
	// Name is the refused name, quoted with Go escapes (%q) and cut to 80
	// bytes.
	Name string
	// Problem says what is wrong with it.
	Problem string
}

func (e *GroupNameError) Error() string {
	return e.Field + ": " + e.Name + " " + e.Problem
}

func (e *GroupNameError) Unwrap() error { return ErrInvalidGroupName }

// ValidateGroupName refuses a consumer group name (or another name stored
// with a group, such as its Idempotency-Key namespace) that PostgreSQL
// cannot store: one containing a NUL byte (no text value can hold it) or bytes that
// are not valid UTF-8 (the client encoding the library uses). Every Config
// and function taking a group name calls it, so a bad name fails at
// Validate with a *[GroupNameError] instead of later with SQLSTATE 22021.
// The empty name is not checked here (each caller says why it needs one). A
// character valid in UTF-8 that a database with another server encoding
// cannot represent is found by the server: [Deduplicator.Register] returns
// it as a *GroupNameError too. field names the configuration field or
// argument in the error.
func ValidateGroupName(field, name string) error {
	switch {
	case strings.IndexByte(name, 0) >= 0:
		return &GroupNameError{Field: field, Name: quoteName(name), Problem: "contains a NUL byte, which PostgreSQL cannot store in text"}
	case !utf8.ValidString(name):
		return &GroupNameError{Field: field, Name: quoteName(name), Problem: "is not valid UTF-8, which PostgreSQL cannot store in text"}
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
// encoding) into a *GroupNameError; other errors are returned unchanged.
func groupNameRefused(field, name string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == pgerrcode.CharacterNotInRepertoire || pgErr.Code == pgerrcode.UntranslatableCharacter) {
		return &GroupNameError{Field: field, Name: quoteName(name), Problem: "is refused by the database (SQLSTATE " + pgErr.Code + ": " + pgErr.Message + ")"}
	}
	return err
}
