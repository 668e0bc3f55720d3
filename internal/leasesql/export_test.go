package leasesql

import (
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

// Statement is one of a protocol's statements with arguments for ids and
// toks, for the plan test (an external test: it migrates the table with
// package deduplicator, which imports this one).
type Statement struct {
	SQL  string
	Args []any
}

// Statements returns p's statements by name, with arguments for group
// "billing", owner "test" and a lease of d.
func Statements(p *Protocol, ids, toks []uuid.UUID, d time.Duration) map[string]Statement {
	pids, ptoks := dbx.UUIDs(ids), dbx.UUIDs(toks)
	lease := d.Microseconds()
	return map[string]Statement{
		"take":          {p.sql.take, []any{pids, ptoks, "billing", lease, "test", p.lockKeys(ids)}},
		"recheck":       {p.sql.doneAfterTake, []any{ptoks, "billing", pids}},
		"state":         {p.sql.state, []any{pids, "billing", ptoks}},
		"complete":      {p.sql.complete, []any{pids, "billing", ptoks}},
		"fast state":    {p.sql.fastState, []any{pids, "billing"}},
		"fast takeover": {p.sql.fastTakeOver, []any{pids, "billing"}},
		"fast claim":    {p.sql.fastClaim, []any{pids, "billing"}},
		"fast lease":    {p.sql.fastLease, []any{pids, ptoks, "billing", lease, "test"}},
	}
}
