// Package auditsql holds the audit trail of the operator's actions taken
// from idemctl serve: its embedded migrations ([Migrations]: the tables
// idem_audit and idem_audit_message, append-only by trigger), [Append] (the
// only writer: one action and the messages it touched, in one transaction),
// [List] (the audit page, newest first) and [Dispositions] (what was last
// done to each record of an explorer page).
//
// No statement here updates or deletes a row, and the tables' triggers
// refuse UPDATE, DELETE and TRUNCATE with SQLSTATE 23001
// (restrict_violation): [ErrAppendOnly] tells it apart.
package auditsql
