// Package permanent holds the mark of an error that redelivery cannot fix,
// shared by the package that offers it (middleware: Permanent, IsPermanent)
// and those below it that make or read it (idemkafka/franz's share-group
// subscriber), so that they need not import middleware: as payloaderr does
// for the malformed-payload sentinel.
package permanent

import "errors"

// markedError marks err permanent.
type markedError struct{ err error }

func (e *markedError) Error() string { return "permanent: " + e.err.Error() }
func (e *markedError) Unwrap() error { return e.err }

// Mark wraps err so that [Marked] reports true; nil stays nil.
func Mark(err error) error {
	if err == nil {
		return nil
	}
	return &markedError{err: err}
}

// Marked reports whether err, or an error it wraps, was marked by [Mark].
func Marked(err error) bool {
	var m *markedError
	return errors.As(err, &m)
}
