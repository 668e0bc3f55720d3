// Package console is idemctl serve's web console: its HTTP handler
// ([Server]), its pages and their JSON twins, its templates and assets
// (embedded from web/), and its actions. What a page shows and what an
// action changes come from the operations layer (cmd/idemctl/internal/ops),
// which the command's subcommands call too; the console itself runs no SQL.
//
// It keeps the console's security: read-only unless [Config.AllowActions];
// every action needs the session's CSRF token, a request from the
// console's own origin, a confirmation and [Config.Token]; a strict
// Content-Security-Policy on every page; on loopback, only requests for a
// loopback host name; and no page shows a secret of [Config.Secrets] or a
// password in a connection string. A page whose template fails is logged
// and answered with a 500.
package console
