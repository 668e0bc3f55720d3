// Package leasetest takes and completes lease-mode leases in tests, on a
// pgtest database, through internal/leasesql.
package leasetest

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

// Req is a request for id's lease with a fresh token.
func Req(id uuid.UUID) leasesql.Request {
	return leasesql.Request{EventID: id, Token: uuid.New()}
}

// Take takes reqs' leases for dur, recorded with owner "test".
func Take(t testing.TB, db *pgtest.DB, p *leasesql.Protocol, dur time.Duration, reqs ...leasesql.Request) []leasesql.Take {
	t.Helper()
	got, err := p.Take(context.Background(), db.Pool, reqs, dur, "test")
	require.NoError(t, err)
	require.Len(t, got, len(reqs))
	return got
}

// Complete completes reqs in a transaction of its own and commits it.
func Complete(t testing.TB, db *pgtest.DB, p *leasesql.Protocol, reqs ...leasesql.Request) []leasesql.Result {
	t.Helper()
	ctx := context.Background()
	var ids, toks []uuid.UUID
	for _, r := range reqs {
		ids, toks = append(ids, r.EventID), append(toks, r.Token)
	}
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	res, err := p.Complete(ctx, tx, ids, toks)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return res
}
