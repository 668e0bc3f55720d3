// Package failuresweb is idemctl serve's failures explorer, history and
// audit pages over the operations of package failures: [Register] mounts
// them on the console's mux, which keeps its own security (the headers and
// CSP of every response, the session, the CSRF token, the origin check,
// the token, the redaction of every page) and hands it in through [Config].
package failuresweb
