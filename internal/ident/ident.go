// Package ident validates and quotes the SQL identifiers (schema and table
// names) that users pass through configuration.
package ident

import (
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// maxLen is PostgreSQL's NAMEDATALEN-1: longer names are silently truncated by
// the server, which would make two configured names collide.
const maxLen = 63

var valid = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// Validate reports whether name is a plain SQL identifier: a letter or
// underscore followed by letters, digits or underscores, at most 63 bytes.
// field names the configuration field in the error.
func Validate(field, name string) error {
	if name == "" {
		return fmt.Errorf("%s: must not be empty", field)
	}
	if len(name) > maxLen {
		return fmt.Errorf("%s: %q is longer than %d bytes", field, name, maxLen)
	}
	if !valid.MatchString(name) {
		return fmt.Errorf("%s: %q is not a plain identifier (letters, digits, underscore; not starting with a digit)", field, name)
	}
	return nil
}

// Quote returns the quoted, dot-joined form of parts, safe to splice into SQL.
func Quote(parts ...string) string {
	return pgx.Identifier(parts).Sanitize()
}
