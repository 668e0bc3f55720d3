package middleware_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// keyServer is a real HTTP server that records the Idempotency-Key of every
// request it receives.
type keyServer struct {
	*httptest.Server
	mu   sync.Mutex
	keys []string
	hits atomic.Int64
}

func newKeyServer(t *testing.T) *keyServer {
	t.Helper()
	s := &keyServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		s.mu.Lock()
		s.keys = append(s.keys, r.Header.Get(idem.IdempotencyKeyHeader))
		s.mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *keyServer) Keys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.keys...)
}

func eventCtx(id uuid.UUID, group string) context.Context {
	return idemctx.With(context.Background(), &idemctx.Value{EventID: id, ConsumerGroup: group})
}

func TestIdempotencyKey_EmptyOperationIsEventID(t *testing.T) {
	t.Parallel()
	id := uuid.Must(uuid.NewV7())
	key, err := idem.IdempotencyKey(eventCtx(id, "billing"), "")
	require.NoError(t, err)
	require.Equal(t, id.String(), key)
}

// The derivation is a public contract (keys must survive upgrades and be
// reproducible elsewhere): these vectors were computed independently with
// Python's uuid.uuid5 over the documented name format.
func TestIdempotencyKey_NamedOperationGoldenVectors(t *testing.T) {
	t.Parallel()
	id := uuid.MustParse("01938a5e-7c4f-7abc-8def-0123456789ab")
	for _, tc := range []struct{ group, op, want string }{
		{"billing-order-confirmed", "charge", "b17c28dd-b5f6-520f-a514-91ea584876dd"},
		{"billing-order-confirmed", "refund", "6d9aa14b-134a-5ecc-951e-74e5669697d1"},
		{"ledger", "charge", "9c257a20-663b-59f1-b1d3-4c04914553a0"},
	} {
		key, err := idem.IdempotencyKey(eventCtx(id, tc.group), tc.op)
		require.NoError(t, err)
		require.Equal(t, tc.want, key, "group %q op %q", tc.group, tc.op)
		u := uuid.MustParse(key)
		require.Equal(t, uuid.Version(5), u.Version())
	}
}

func TestIdempotencyKey_DistinctPerEventGroupAndOperation(t *testing.T) {
	t.Parallel()
	e1, e2 := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	seen := map[string]string{}
	for _, e := range []uuid.UUID{e1, e2} {
		for _, g := range []string{"billing", "billing-x", "audit"} {
			for _, op := range []string{"", "charge", "refund"} {
				k, err := idem.IdempotencyKey(eventCtx(e, g), op)
				require.NoError(t, err)
				again, err := idem.IdempotencyKey(eventCtx(e, g), op)
				require.NoError(t, err)
				require.Equal(t, k, again, "deterministic")
				if op == "" {
					continue // the event id itself, shared by groups by design
				}
				label := e.String() + "|" + g + "|" + op
				prev, dup := seen[k]
				require.False(t, dup, "key %s of %s collides with %s", k, label, prev)
				seen[k] = label
			}
		}
	}
	// The length prefix keeps group/operation boundaries unambiguous.
	a, err := idem.IdempotencyKey(eventCtx(e1, "a/b"), "c")
	require.NoError(t, err)
	b, err := idem.IdempotencyKey(eventCtx(e1, "a"), "b/c")
	require.NoError(t, err)
	require.NotEqual(t, a, b)
}

func TestIdempotencyKey_NoEventInContext(t *testing.T) {
	t.Parallel()
	for _, ctx := range []context.Context{context.Background(), idemctx.With(context.Background(), &idemctx.Value{})} {
		key, err := idem.IdempotencyKey(ctx, "charge")
		require.ErrorIs(t, err, idem.ErrNotInHandler)
		require.Empty(t, key)
	}
}

func TestIdempotencyKeyTransport_SetsKeyFromContext(t *testing.T) {
	t.Parallel()
	srv := newKeyServer(t)
	id := uuid.Must(uuid.NewV7())
	ctx := eventCtx(id, "billing")

	charge := &http.Client{Transport: idem.NewIdempotencyKeyTransport(srv.Client().Transport, "charge")}
	plain := &http.Client{Transport: idem.NewIdempotencyKeyTransport(nil, "")}
	for _, c := range []*http.Client{charge, plain} {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"amount":1}`))
		require.NoError(t, err)
		resp, err := c.Do(req)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		require.Empty(t, req.Header.Get(idem.IdempotencyKeyHeader), "the caller's request is not modified")
	}
	wantCharge, err := idem.IdempotencyKey(ctx, "charge")
	require.NoError(t, err)
	require.Equal(t, []string{wantCharge, id.String()}, srv.Keys())
}

func TestIdempotencyKeyTransport_KeepsCallerKey(t *testing.T) {
	t.Parallel()
	srv := newKeyServer(t)
	c := &http.Client{Transport: idem.NewIdempotencyKeyTransport(nil, "charge")}
	// With and without an event in context: a caller-set key wins and is sent.
	for _, ctx := range []context.Context{eventCtx(uuid.Must(uuid.NewV7()), "g"), context.Background()} {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, nil)
		require.NoError(t, err)
		req.Header.Set(idem.IdempotencyKeyHeader, "caller-key")
		resp, err := c.Do(req)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
	}
	require.Equal(t, []string{"caller-key", "caller-key"}, srv.Keys())
}

type closeTracker struct {
	io.Reader
	closed atomic.Bool
}

func (c *closeTracker) Close() error { c.closed.Store(true); return nil }

func TestIdempotencyKeyTransport_RefusesWithoutEvent(t *testing.T) {
	t.Parallel()
	srv := newKeyServer(t)
	c := &http.Client{Transport: idem.NewIdempotencyKeyTransport(nil, "charge")}
	body := &closeTracker{Reader: strings.NewReader(`{"amount":1}`)}
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL, body)
	require.NoError(t, err)
	resp, err := c.Do(req)
	if resp != nil {
		_ = resp.Body.Close()
	}
	require.ErrorIs(t, err, idem.ErrNotInHandler)
	require.Contains(t, err.Error(), "refusing to send POST")
	require.Zero(t, srv.hits.Load(), "the request must not reach the server")
	require.True(t, body.closed.Load(), "RoundTrip closes the body on refusal")
}

func TestIdempotencyKeyTransport_OperationFunc(t *testing.T) {
	t.Parallel()
	srv := newKeyServer(t)
	id := uuid.Must(uuid.NewV7())
	ctx := eventCtx(id, "billing")
	tr := &idem.IdempotencyKeyTransport{Operation: "ignored", OperationFunc: func(r *http.Request) string {
		return strings.TrimPrefix(r.URL.Path, "/")
	}}
	c := &http.Client{Transport: tr}
	for _, p := range []string{"/charge", "/refund"} {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+p, nil)
		require.NoError(t, err)
		resp, err := c.Do(req)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
	}
	k1, _ := idem.IdempotencyKey(ctx, "charge")
	k2, _ := idem.IdempotencyKey(ctx, "refund")
	require.Equal(t, []string{k1, k2}, srv.Keys())
}

// IDEM-4 through the real middleware: the handler's call succeeds at the
// provider, then the transaction rolls back (lost response, crash before
// COMMIT); the redelivery calls again with the same key; once committed, a
// further duplicate does not call at all.
func TestIdempotencyKeyTransport_SameKeyAcrossRedelivery(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 4)
	ctx := context.Background()
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	d, err := idem.NewDedup(idem.Config{DB: db.Pool, ConsumerGroup: "billing", Table: table}, nil)
	require.NoError(t, err)

	srv := newKeyServer(t)
	client := &http.Client{Transport: idem.NewIdempotencyKeyTransport(srv.Client().Transport, "charge")}
	var failNext atomic.Bool
	failNext.Store(true)
	errLost := errors.New("response lost")
	h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		req, err := http.NewRequestWithContext(msg.Context(), http.MethodPost, srv.URL, strings.NewReader(`{"amount":100}`))
		if err != nil {
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, err
		}
		_ = resp.Body.Close()
		if failNext.CompareAndSwap(true, false) {
			return nil, errLost
		}
		return nil, nil
	})

	id := uuid.Must(uuid.NewV7())
	newMsg := func() *message.Message {
		m := message.NewMessage(uuid.NewString(), []byte(`{}`))
		m.Metadata.Set("event_id", id.String())
		return m
	}
	_, err = h(newMsg())
	require.ErrorIs(t, err, errLost)
	_, err = h(newMsg()) // redelivery
	require.NoError(t, err)
	_, err = h(newMsg()) // duplicate after commit: skipped, no call
	require.NoError(t, err)

	keys := srv.Keys()
	require.Len(t, keys, 2)
	require.Equal(t, keys[0], keys[1], "the redelivery reuses the key")
	k, err := idem.IdempotencyKey(eventCtx(id, "billing"), "charge")
	require.NoError(t, err)
	require.Equal(t, k, keys[0])
	require.Equal(t, 1, db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", id))
}

// Outside a handler every accessor reports the one sentinel: the key
// helpers return it, MustTxFromContext panics with it.
func TestNotInHandlerIsOneError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := idem.IdempotencyKey(ctx, "charge")
	require.ErrorIs(t, err, idem.ErrNotInHandler)
	require.PanicsWithError(t, idem.ErrNotInHandler.Error(), func() { idem.MustTxFromContext(ctx) })
	_, ok := idem.TxFromContext(ctx)
	require.False(t, ok)
}
