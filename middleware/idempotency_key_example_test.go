package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// idemKeyExampleDB creates a throwaway schema with the processed_event table
// and returns a pool on it and a cleanup that drops the schema.
func idemKeyExampleDB(ctx context.Context) (*pgxpool.Pool, string, func()) {
	pool, schema, drop := pgtest.ForExample(ctx, "example_idemkey")
	if err := migrate.Up(ctx, pool, deduplicator.MigrationLine(deduplicator.TableConfig{Schema: schema})); err != nil {
		panic(err)
	}
	return pool, schema, drop
}

// A handler derives one key per downstream operation from the event it
// handles; the same event always yields the same keys.
func ExampleIdempotencyKey() {
	ctx := context.Background()
	pool, schema, cleanup := idemKeyExampleDB(ctx)
	defer cleanup()

	dedup, err := idem.NewDedup(idem.Config{
		DB:            pool,
		ConsumerGroup: "billing-order-confirmed",
		Table:         deduplicator.TableConfig{Schema: schema},
	}, nil)
	if err != nil {
		panic(err)
	}
	eventID := uuid.Must(uuid.NewV7())
	handler := dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		plain, err := idem.IdempotencyKey(msg.Context(), "")
		if err != nil {
			return nil, err
		}
		charge, _ := idem.IdempotencyKey(msg.Context(), "charge")
		refund, _ := idem.IdempotencyKey(msg.Context(), "refund-fee")
		fmt.Println("\"\" is the event id:", plain == eventID.String())
		fmt.Println("charge is a UUIDv5:", uuid.MustParse(charge).Version() == 5)
		fmt.Println("charge != refund-fee:", charge != refund)
		return nil, nil
	})

	msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
	msg.Metadata.Set("event_id", eventID.String())
	if _, err := handler(msg); err != nil {
		panic(err)
	}

	_, err = idem.IdempotencyKey(context.Background(), "charge")
	fmt.Println("outside a handler:", errors.Is(err, idem.ErrNotInHandler))
	// Output:
	// "" is the event id: true
	// charge is a UUIDv5: true
	// charge != refund-fee: true
	// outside a handler: true
}

// The transport adds the Idempotency-Key to every request made with the
// handler's context, and refuses to send a money call without one.
func ExampleNewIdempotencyKeyTransport() {
	ctx := context.Background()
	pool, schema, cleanup := idemKeyExampleDB(ctx)
	defer cleanup()

	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println("provider got a key:", r.Header.Get(idem.IdempotencyKeyHeader) != "")
		w.WriteHeader(http.StatusCreated)
	}))
	defer provider.Close()
	client := &http.Client{Transport: idem.NewIdempotencyKeyTransport(nil, "charge")}

	dedup, err := idem.NewDedup(idem.Config{
		DB:            pool,
		ConsumerGroup: "billing-order-confirmed",
		Table:         deduplicator.TableConfig{Schema: schema},
	}, nil)
	if err != nil {
		panic(err)
	}
	handler := dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		req, err := http.NewRequestWithContext(msg.Context(), http.MethodPost, provider.URL+"/charges", strings.NewReader(`{"amount":"42.00"}`))
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err // rollback, redelivery calls again with the same key
		}
		defer resp.Body.Close()
		fmt.Println("status:", resp.StatusCode)
		return nil, nil
	})

	msg := message.NewMessage(uuid.NewString(), []byte(`{}`))
	msg.Metadata.Set("event_id", uuid.Must(uuid.NewV7()).String())
	if _, err := handler(msg); err != nil {
		panic(err)
	}

	// Outside a handler there is no event: the request is never sent.
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL+"/charges", nil)
	_, err = client.Do(req)
	fmt.Println("refused:", errors.Is(err, idem.ErrNotInHandler))
	// Output:
	// provider got a key: true
	// status: 201
	// refused: true
}
