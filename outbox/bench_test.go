package outbox_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// BenchmarkPublishInTx writes one message to the outbox in a transaction of
// its own (BEGIN, stamp and the INSERT watermill-sql would run, COMMIT), against the
// real PostgreSQL in a schema of its own, on one connection whose round trips
// are counted (roundtrips/op). It runs only with -bench (make bench/go).
func BenchmarkPublishInTx(b *testing.B) {
	ctx := b.Context()
	db := pgtest.New(b, 1)
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{"payments"}}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	if err := migrate.Up(ctx, db.Pool, outbox.MigrationLine(ob.Config(), "payments")); err != nil {
		b.Fatal(err)
	}
	rt := &rtcount.Counter{}
	pool := db.CountingPool(b, 1, rt)
	payload := []byte(`{"account":"acct-1","amountCents":1250}`)
	publish := func() error {
		msg := publisher.WithPartitionKey(message.NewMessage(watermill.NewUUID(), payload), "acct-1")
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return ob.PublishInTx(ctx, tx, "payments", msg) })
	}
	if err := publish(); err != nil { // dial, prepare
		b.Fatal(err)
	}
	rt.Reset()
	for b.Loop() {
		if err := publish(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(rt.Load())/float64(b.N), "roundtrips/op")
}
