// Package failures is the operations layer of idemctl serve's failures
// explorer: a poison topic paged by offset with what was already done to
// each record ([Explorer.Page]), its failures grouped by reason
// ([Explorer.Reasons]), one record's detail ([Explorer.Detail]), the
// operator's actions — replay, discard, edit-and-replay, singly or for a
// filter — each written to the append-only audit trail (internal/auditsql)
// with who, when, what, which messages and the result, and the last hour's
// history from the instances' heartbeats ([Explorer.History]).
//
// Edit-and-replay validates the edited payload with the event's contract
// (the JSON Schema that contract.Contract.JSONSchema writes, loaded by
// [LoadContracts]) and keeps the event's id, so that the consumers' claims
// still dedup it; the original payload is kept in the audit trail.
package failures
