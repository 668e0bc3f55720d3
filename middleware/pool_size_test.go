package middleware_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// A pool smaller than the declared concurrency is refused at start-up; with
// group commit only the concurrent groups need connections.
func TestNewDedupChecksPoolAgainstConcurrency(t *testing.T) {
	f := newLedgerFixture(t) // pool of 8
	_, err := idem.NewDedup(idemConfig(f, func(c *idem.Config) { c.Concurrency = 16 }), nil)
	require.ErrorIs(t, err, idem.ErrPoolTooSmall)
	require.ErrorContains(t, err, "the pool has MaxConns 8, but up to 16 messages run at once, each holding a connection for its transaction (give the pool at least 16")

	f.dedup(t, "fits", func(c *idem.Config) { c.Concurrency = 8 })
	f.dedup(t, "groups", func(c *idem.Config) {
		c.Concurrency = 64
		c.Mode = &idem.GroupCommitConfig{Concurrency: 4}
	})
	_, err = idem.NewDedup(idemConfig(f, func(c *idem.Config) {
		c.Concurrency = 64
		c.Mode = &idem.GroupCommitConfig{Concurrency: 12}
	}), nil)
	require.ErrorIs(t, err, idem.ErrPoolTooSmall)
}

func idemConfig(f *ledgerFixture, mod func(*idem.Config)) idem.Config {
	cfg := idem.Config{DB: f.pool, ConsumerGroup: "pool", Table: deduplicator.TableConfig{Schema: f.db.Schema}}
	mod(&cfg)
	return cfg
}
