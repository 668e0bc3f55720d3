package middleware_test

import (
	"errors"
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
	var pe *idem.PoolSizeError
	require.True(t, errors.As(err, &pe))
	require.Equal(t, idem.PoolSizeError{MaxConns: 8, Need: 16, Concurrency: 16}, *pe)

	f.dedup(t, "fits", func(c *idem.Config) { c.Concurrency = 8 })
	f.dedup(t, "groups", func(c *idem.Config) {
		c.Concurrency = 64
		c.GroupCommit = &idem.GroupCommitConfig{Concurrency: 4}
	})
	_, err = idem.NewDedup(idemConfig(f, func(c *idem.Config) {
		c.Concurrency = 64
		c.GroupCommit = &idem.GroupCommitConfig{Concurrency: 12}
	}), nil)
	require.ErrorIs(t, err, idem.ErrPoolTooSmall)
}

func idemConfig(f *ledgerFixture, mod func(*idem.Config)) idem.Config {
	cfg := idem.Config{DB: f.pool, ConsumerGroup: "pool", Table: deduplicator.TableConfig{Schema: f.db.Schema}}
	mod(&cfg)
	return cfg
}
