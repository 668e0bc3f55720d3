// Package ops is idemctl's operations layer: what the command and its
// console (idemctl serve) read from and change in the database, written
// once for both, and the JSON shapes they report it in (`idemctl ... --json`
// and the console's /api pages share them). The command parses flags and
// prints; the console serves pages; neither repeats an operation.
//
// Errors: [ErrNotFound] for a name that is not there, an [*InputError] for
// input that names something not allowed ([IsBadInput] also reports the
// library's own such errors); nothing was changed after either.
package ops
