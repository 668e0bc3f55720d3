package middleware_test

// Edges: names PostgreSQL cannot store, payloads with a UTF-8
// byte order mark, against the real PostgreSQL.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// requireGroupNameError asserts err wraps deduplicator.ErrInvalidGroupName
// and names field and the refused name, never a raw SQLSTATE.
func requireGroupNameError(t *testing.T, err error, field, name, what string) {
	t.Helper()
	require.ErrorIs(t, err, deduplicator.ErrInvalidGroupName, what)
	require.Contains(t, err.Error(), field+": "+fmt.Sprintf("%q", name)+" ", what)
	require.NotContains(t, err.Error(), "SQLSTATE", what)
}

// A consumer group name (or an Idempotency-Key namespace) PostgreSQL cannot
// store in text, a NUL byte or bytes that are not UTF-8, is refused by
// Validate of every Config that takes one, and by every function that takes
// one, with a typed error, before any SQL; nothing is registered.
func TestEdgeGroupNameUnstorableRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	table := deduplicator.TableConfig{Schema: f.db.Schema}
	good := f.dedup(t, "billing", nil) // registered, the source of a rename
	_ = good
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	handoff, err := outbox.New(outbox.Config{Schema: f.db.Schema, Topics: []string{"orders-retry"}}, nil)
	require.NoError(t, err)

	for _, bad := range []string{"bill\x00ing", "\x00", "bill\xffing", "bill\xc3", "\xed\xa0\x80"} { // NUL; invalid UTF-8: 0xff, a cut sequence, a surrogate
		what := []byte(bad)
		cfg := idem.Config{DB: f.pool, ConsumerGroup: bad, Table: table}
		requireGroupNameError(t, cfg.Validate(), "ConsumerGroup", bad, string(what))
		_, err := idem.NewDedup(cfg, nil)
		requireGroupNameError(t, err, "ConsumerGroup", bad, "NewDedup")

		cfg = idem.Config{DB: f.pool, ConsumerGroup: "billing2", IdempotencyNamespace: bad, Table: table}
		requireGroupNameError(t, cfg.Validate(), "IdempotencyNamespace", bad, "namespace")
		_, err = idem.NewDedup(cfg, nil)
		requireGroupNameError(t, err, "IdempotencyNamespace", bad, "NewDedup namespace")

		dcfg := deduplicator.Config{TableConfig: table, ConsumerGroup: bad}
		requireGroupNameError(t, dcfg.Validate(), "ConsumerGroup", bad, "deduplicator.Config")
		_, err = deduplicator.New(dcfg, nil)
		requireGroupNameError(t, err, "ConsumerGroup", bad, "deduplicator.New")

		// idemctl groups rename and forget (and the console) check names so.
		_, _, err = deduplicator.RenameGroup(ctx, f.pool, table, "billing", bad)
		requireGroupNameError(t, err, "to", bad, "RenameGroup to")
		_, _, err = deduplicator.RenameGroup(ctx, f.pool, table, bad, "billing3")
		requireGroupNameError(t, err, "from", bad, "RenameGroup from")
		_, err = deduplicator.ForgetGroup(ctx, f.pool, table, bad)
		requireGroupNameError(t, err, "group", bad, "ForgetGroup")
		_, err = deduplicator.ConvertTable(ctx, f.pool, table, deduplicator.ConvertOptions{ConsumerGroup: bad})
		requireGroupNameError(t, err, "ConvertOptions.ConsumerGroup", bad, "ConvertTable")

		rcfg := retrytopic.Config{Publisher: pub, Topics: []string{"orders-retry"}, PoisonTopic: "orders-poison",
			KeyOrder: &retrytopic.KeyOrder{DB: f.pool, Outbox: handoff, ConsumerGroup: bad}}
		requireGroupNameError(t, rcfg.Validate(), "KeyOrder.ConsumerGroup", bad, "retrytopic KeyOrder")
		_, err = parkedsql.Keys(ctx, f.pool, f.db.Schema, "", bad, 0, deduplicator.ValidateGroupName)
		requireGroupNameError(t, err, "consumerGroup", bad, "ParkedKeys")
		_, err = parkedsql.Summarize(ctx, f.pool, f.db.Schema, "", bad, deduplicator.ValidateGroupName)
		requireGroupNameError(t, err, "consumerGroup", bad, "SummarizeParked")
	}
	groups, err := dedupsql.Groups(ctx, f.pool, table.Schema, table.Table)
	require.NoError(t, err)
	require.Len(t, groups, 1, "only billing is registered")
	require.Equal(t, "billing", groups[0].Name)

	// Names PostgreSQL stores are accepted: any valid UTF-8, control
	// characters and spaces included.
	for _, ok := range []string{"événement", "a b\tc", "日本", "x\u2028y"} {
		f.dedup(t, ok, nil)
	}
}

// bomPayload is a JSON object carrying eventId, preceded by a UTF-8 byte
// order mark (as some Windows tools and .NET serializers write it).
func bomPayload(id uuid.UUID) []byte {
	return append([]byte("\xef\xbb\xbf"), []byte(`{"eventId":"`+id.String()+`","amount":1}`)...)
}

// A payload starting with a UTF-8 BOM keeps its eventId: Stamp copies it to
// the event_id metadata (publishing the same payload twice gives one event
// id, so the consumer applies it once), and the middleware's extraction
// reads the same id from the payload alone and checks it against the
// metadata (producer and consumer agree).
func TestEdgeBOMPayloadEventIDHonoured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	var calls atomic.Int32
	h := d.Middleware(f.insertHandler(1, &calls))

	id := publisher.NewEventID()
	for i := range 2 { // the producer publishes the same payload twice
		m := message.NewMessage(uuid.NewString(), bomPayload(id))
		got, err := publisher.Stamp(ctx, m)
		require.NoError(t, err)
		require.Equal(t, id, got, "publish %d: the payload's eventId is the event id", i)
		require.Equal(t, id.String(), m.Metadata.Get(publisher.MetadataEventID))
		_, err = h(m)
		require.NoError(t, err)
	}
	require.EqualValues(t, 1, calls.Load(), "the same event applied once")
	require.Equal(t, 1, f.ledgerRows(t))

	// A producer outside this library: no metadata, the id in the BOM payload.
	id2 := publisher.NewEventID()
	m := message.NewMessage(uuid.NewString(), bomPayload(id2))
	got, err := publisher.EventIDFromMessage(m)
	require.NoError(t, err)
	require.Equal(t, id2, got)
	_, err = h(m)
	require.NoError(t, err)
	require.Equal(t, 1, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", id2))

	// Metadata and a BOM payload that disagree are refused, as without a BOM.
	m = message.NewMessage(uuid.NewString(), bomPayload(publisher.NewEventID()))
	m.Metadata.Set(publisher.MetadataEventID, id.String())
	_, err = publisher.Stamp(ctx, m)
	require.ErrorIs(t, err, publisher.ErrEventIDMismatch)
	_, err = h(m)
	require.ErrorIs(t, err, publisher.ErrEventIDMismatch)
	require.True(t, idem.IsPermanent(err))
	require.True(t, errors.Is(err, publisher.ErrEventIDMismatch))
	require.EqualValues(t, 2, calls.Load())
}

// swallowingHandler writes its ledger row, then for the ids in bad runs a
// statement that fails and swallows the error, returning nil: the
// transaction it was handed is aborted (SQLSTATE 25P02 for everything
// after), which the handler does not say.
func (f *ledgerFixture) swallowingHandler(calls *atomic.Int32, bad ...uuid.UUID) message.HandlerFunc {
	insert := f.insertHandler(1, calls)
	return func(m *message.Message) ([]*message.Message, error) {
		if _, err := insert(m); err != nil {
			return nil, err
		}
		ctx := m.Context()
		if id, _ := idem.EventIDFromContext(ctx); slices.Contains(bad, id) {
			_, _ = idem.MustTxFromContext(ctx).Exec(ctx, "SELECT 1/0") // error swallowed
		}
		return nil, nil
	}
}

// Group commit: a handler that swallows an SQL error leaves the shared
// transaction aborted. It is the culprit: it alone goes to single mode
// (where it fails with ErrTxAborted and stays alone on its later attempts),
// while the rest of its group, rolled back with it, commits as a group on
// its retry: no innocent message is processed alone or fails.
func TestEdgeGroupCommitAbortedTxOnlyTheCulpritGoesAlone(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := groupDedup(t, f, "billing")
	ids := newIDs(12)
	bad := []uuid.UUID{ids[2], ids[9]}
	var calls atomic.Int32
	h := d.Middleware(f.swallowingHandler(&calls, bad...))
	for i, err := range deliverAll(h, f.msgs(ids)) {
		if slices.Contains(bad, ids[i]) {
			require.ErrorIs(t, err, idem.ErrTxAborted, "delivery %d: the culprit fails, named", i)
			require.False(t, idem.IsPermanent(err), "retryable: the swallowed error may be transient")
			continue
		}
		require.NoError(t, err, "delivery %d: an innocent message", i)
	}
	st := d.Stats()
	require.EqualValues(t, 10, st.Processed)
	require.EqualValues(t, len(bad), st.Alone, "only the culprits were processed alone")
	require.GreaterOrEqual(t, st.GroupFallbacks, uint64(1))
	require.Equal(t, 10, f.ledgerRows(t))
	require.Equal(t, 10, f.claims(t))
	for _, id := range bad {
		require.Zero(t, f.db.Count(t, "SELECT 1 FROM ledger WHERE event_id = $1", id))
		require.Zero(t, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", id))
	}

	// A culprit's next attempt goes alone at once, and fails the same way.
	fallbacks := d.Stats().GroupFallbacks
	_, err := h(f.msg(bad[0]))
	require.ErrorIs(t, err, idem.ErrTxAborted)
	require.Equal(t, fallbacks, d.Stats().GroupFallbacks)
	require.EqualValues(t, len(bad)+1, d.Stats().Alone)
	require.Zero(t, f.pool.Stat().AcquiredConns())
}

// Single mode: a handler that swallows an SQL error gets ErrTxAborted (not
// the COMMIT's "unexpectedly resulted in rollback"); nothing is committed.
func TestEdgeSingleAbortedTxNamed(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	d := f.dedup(t, "billing", nil)
	id := publisher.NewEventID()
	var calls atomic.Int32
	h := d.Middleware(f.swallowingHandler(&calls, id))
	_, err := h(f.msg(id))
	require.ErrorIs(t, err, idem.ErrTxAborted)
	require.Zero(t, f.ledgerRows(t))
	require.Zero(t, f.claims(t))
	require.EqualValues(t, 1, d.Stats().Failed)
}
