package middleware_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

func TestStatsCountEveryOutcome(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.New(t, 4)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "stats", Table: table}, nil)
	require.NoError(t, err)

	fail := true
	h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if fail {
			fail = false
			return nil, errors.New("boom")
		}
		return nil, nil
	})
	msgWith := func(id string) *message.Message {
		m := message.NewMessage("m", []byte(`{}`))
		if id != "" {
			m.Metadata.Set(publisher.MetadataEventID, id)
		}
		return m
	}
	id := publisher.NewEventID().String()
	_, err = h(msgWith(id)) // handler error: failed
	require.Error(t, err)
	_, err = h(msgWith(id)) // processed
	require.NoError(t, err)
	_, err = h(msgWith(id)) // duplicate
	require.NoError(t, err)
	for _, bad := range []string{"", "not-a-uuid", uuid.Nil.String(), uuid.NewString()} {
		_, err = h(msgWith(bad))
		require.True(t, idem.IsPermanent(err), "%q: %v", bad, err)
	}

	s := d.Stats()
	require.Equal(t, uint64(1), s.Processed)
	require.Equal(t, uint64(1), s.Duplicates)
	require.Equal(t, uint64(1), s.Failed)
	require.Equal(t, uint64(0), s.ClaimErrors)
	require.Equal(t, idem.RejectedStats{MissingEventID: 1, InvalidEventID: 1, NilEventID: 1, NotUUIDv7: 1}, s.Rejected)
	require.Equal(t, uint64(4), rejectedTotal(s.Rejected))
	require.Equal(t, uint64(3), s.ClaimCount)
	require.Positive(t, s.ClaimDuration)
	require.Positive(t, s.TxDuration)
}

func rejectedTotal(r idem.RejectedStats) uint64 {
	var n uint64
	for _, c := range r.ByReason() {
		n += c
	}
	return n
}
