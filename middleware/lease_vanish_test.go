package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/netfault"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// A database server that vanishes without a reset (no RST, no FIN: a
// frozen VM, a dropped route) in the middle of a phase holds nothing for
// good. The phase gives up after LeaseConfig.Duration with an error (the message
// is nacked), and another consumer, its server reachable, completes the
// event once the lease the take wrote (if any) has expired: one ledger
// row, one claim, one Idempotency-Key at the provider.
func TestLease_ServerVanishesDuringAPhase(t *testing.T) {
	t.Parallel()
	for _, phase := range []string{"take", "complete"} {
		t.Run(phase, func(t *testing.T) {
			t.Parallel()
			f := newLedgerFixture(t)
			cfg, err := pgxpool.ParseConfig(f.db.URL)
			require.NoError(t, err)
			cfg.MaxConns = 4
			bh := netfault.NewBlackhole()
			cfg.ConnConfig.DialFunc = bh.Dial
			vanishing, err := pgxpool.NewWithConfig(context.Background(), cfg)
			require.NoError(t, err)
			t.Cleanup(vanishing.Close)
			t.Cleanup(bh.Release) // first: ends the blocked reads, so that Close returns

			d := f.dedup(t, "billing", func(c *idem.Config) {
				c.DB = vanishing
				c.Mode = &idem.LeaseConfig{Duration: time.Second}
			})
			provider := newKeyServer(t)
			var calls atomic.Int32
			inCall := func(context.Context) { bh.Cut() } // after the call, before the completion
			if phase == "take" {
				bh.Cut()
				inCall = nil
			}
			id := publisher.NewEventID()
			_, err = d.Middleware(chargeHandler(t, provider, &calls, inCall))(f.msg(id))
			require.Error(t, err, "the %s gave up", phase)
			require.Zero(t, f.ledgerRows(t))
			require.Zero(t, f.claims(t))

			other := f.dedup(t, "billing", func(c *idem.Config) {
				c.Mode = &idem.LeaseConfig{Duration: time.Second, BusyWait: 10 * time.Second}
			})
			_, err = other.Middleware(chargeHandler(t, provider, &calls, nil))(f.msg(id))
			require.NoError(t, err)
			require.Equal(t, 1, f.ledgerRows(t))
			require.Equal(t, 1, f.claims(t))
			keys := provider.Keys()
			for _, k := range keys {
				require.Equal(t, keys[0], k, "every call carried the event's one Idempotency-Key")
			}
			if phase == "take" {
				require.EqualValues(t, 1, calls.Load(), "no handler ran without a lease")
			}
		})
	}
}
