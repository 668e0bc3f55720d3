package middleware_test

// Benchmarks of one message on the hot path, against the real PostgreSQL
// (DATABASE_URL), each in a schema of its own, on one connection whose round
// trips are counted (reported as roundtrips/op). They run only with -bench
// (make bench/go). Absolute ns/op depend on the machine and its load: make
// bench measures the same paths as ratios against a baseline interleaved in
// the same run, which is what docs/benchmarks.md quotes.

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// benchDB creates processed_event and the business table in a fresh schema,
// and returns a one-connection pool on it whose round trips rt counts.
func benchDB(b *testing.B) (*pgxpool.Pool, deduplicator.TableConfig, *rtcount.Counter) {
	b.Helper()
	db := pgtest.New(b, 1)
	table := deduplicator.TableConfig{Schema: db.Schema}
	if err := migrate.Up(b.Context(), db.Pool, deduplicator.MigrationLine(table)); err != nil {
		b.Fatal(err)
	}
	db.Exec(b, "CREATE TABLE payment (event_id uuid PRIMARY KEY, amount_cents bigint NOT NULL)")
	rt := &rtcount.Counter{}
	return db.CountingPool(b, 1, rt), table, rt
}

// applyPayment is the handler of every benchmark here: one business row,
// written in tx.
func applyPayment(msg *message.Message, tx pgx.Tx) error {
	id, err := uuid.Parse(msg.UUID)
	if err != nil {
		return err
	}
	_, err = tx.Exec(msg.Context(), "INSERT INTO payment (event_id, amount_cents) VALUES ($1, $2)", id, int64(42))
	return err
}

// paymentMessage is a message carrying id as its UUID and its event_id.
func paymentMessage(id uuid.UUID) *message.Message {
	msg := message.NewMessage(id.String(), []byte(`{"amountCents":42}`))
	msg.Metadata.Set(publisher.MetadataEventID, id.String())
	return msg
}

// dedupHandler is applyPayment behind the dedup middleware; *ran counts the
// handler's runs.
func dedupHandler(b *testing.B, pool *pgxpool.Pool, table deduplicator.TableConfig, ran *int) message.HandlerFunc {
	b.Helper()
	d, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "bench", Table: table}, nil)
	if err != nil {
		b.Fatal(err)
	}
	return d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		*ran++
		return nil, applyPayment(msg, idem.MustTxFromContext(msg.Context()))
	})
}

func reportRoundTrips(b *testing.B, rt *rtcount.Counter) {
	b.ReportMetric(float64(rt.Load())/float64(b.N), "roundtrips/op")
}

// BenchmarkDedup is one message through the dedup middleware: first, a new
// event ({BEGIN + claim} pipelined, the handler's INSERT, COMMIT); duplicate,
// an event already processed ({BEGIN + claim}, ROLLBACK; the handler does
// not run).
func BenchmarkDedup(b *testing.B) {
	b.Run("first", func(b *testing.B) {
		pool, table, rt := benchDB(b)
		var ran int
		h := dedupHandler(b, pool, table, &ran)
		if _, err := h(paymentMessage(uuid.Must(uuid.NewV7()))); err != nil { // dial, prepare
			b.Fatal(err)
		}
		ran = 0
		rt.Reset()
		for b.Loop() {
			if _, err := h(paymentMessage(uuid.Must(uuid.NewV7()))); err != nil {
				b.Fatal(err)
			}
		}
		reportRoundTrips(b, rt)
		if ran != b.N {
			b.Fatalf("the handler ran %d times for %d new events", ran, b.N)
		}
	})
	b.Run("duplicate", func(b *testing.B) {
		pool, table, rt := benchDB(b)
		var ran int
		h := dedupHandler(b, pool, table, &ran)
		id := uuid.Must(uuid.NewV7())
		for range 2 { // processed, then skipped once: dial, prepare
			if _, err := h(paymentMessage(id)); err != nil {
				b.Fatal(err)
			}
		}
		ran = 0
		rt.Reset()
		for b.Loop() {
			if _, err := h(paymentMessage(id)); err != nil {
				b.Fatal(err)
			}
		}
		reportRoundTrips(b, rt)
		if ran != 0 {
			b.Fatalf("the handler ran %d times for duplicates", ran)
		}
	})
}

// BenchmarkPlainTx is the baseline of BenchmarkDedup/first: the same handler
// in a plain transaction (BEGIN, INSERT, COMMIT), no claim.
func BenchmarkPlainTx(b *testing.B) {
	pool, _, rt := benchDB(b)
	handle := func(msg *message.Message) error {
		return pgx.BeginFunc(msg.Context(), pool, func(tx pgx.Tx) error { return applyPayment(msg, tx) })
	}
	if err := handle(paymentMessage(uuid.Must(uuid.NewV7()))); err != nil { // dial, prepare
		b.Fatal(err)
	}
	rt.Reset()
	for b.Loop() {
		if err := handle(paymentMessage(uuid.Must(uuid.NewV7()))); err != nil {
			b.Fatal(err)
		}
	}
	reportRoundTrips(b, rt)
}
