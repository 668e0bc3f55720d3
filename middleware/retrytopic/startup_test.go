package retrytopic_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/netfault"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// refusingOutbox is an OutboxWriter that is never reached: New's check
// stops at the database first.
type refusingOutbox struct{}

func (refusingOutbox) PublishInTx(context.Context, pgx.Tx, string, ...*message.Message) error {
	return context.Canceled
}

// nopPublisher is never reached either.
type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// New's check of the database is bounded by StartupTimeout, as NewDedup's
// is: a server gone silent (no reset) makes New return the deadline's
// error. Before, it checked with context.Background() and hung for good.
func TestNewIsBoundedByStartupTimeout(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 1)
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	bh := netfault.NewBlackhole()
	cfg.ConnConfig.DialFunc = bh.Dial
	silent, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(silent.Close)
	t.Cleanup(bh.Release) // first: ends the blocked reads, so that Close returns
	bh.Cut()

	done := make(chan error, 1)
	go func() {
		_, err := retrytopic.New(retrytopic.Config{
			Publisher: nopPublisher{}, Topics: []string{"retry"}, PoisonTopic: "poison",
			StartupTimeout: 100 * time.Millisecond,
			KeyOrder:       &retrytopic.KeyOrder{DB: silent, Outbox: refusingOutbox{}, ConsumerGroup: "g"},
		}, nil)
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(time.Minute): // a stall guard, not a timing claim
		t.Fatal("retrytopic.New did not return: its start-up check is unbounded")
	}
}
