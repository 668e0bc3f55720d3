// Package payloaderr holds the sentinel of a payload that cannot be decoded,
// shared by the packages that refuse one (contract) and the one that routes
// it (middleware, whose ErrMalformedPayload is this value), so neither
// imports the other: franz-go's kerr plays the same part for kgo and kadm.
package payloaderr

import "errors"

// ErrMalformed is middleware.ErrMalformedPayload: errors.Is holds between
// the two names because they are one value.
var ErrMalformed = errors.New("malformed payload")
