package middleware_test

// Group commit and the outbox: the rows a group's handlers write, however
// they write them (returned messages, PublisherFromContext, Publisher on
// the transaction), go in one INSERT per table before the COMMIT, in the
// order the handlers wrote them.

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

const gcOutTopic = "gc-out"

// gcOutboxFixture is a group-commit middleware with an outbox on a pool of
// ONE connection, whose round trips and statements are counted: a group
// waiting for the slot needs no connection, so a blocker holding the slot
// (and the connection) lets a group of exactly k gather, and every group
// runs on the same connection (the same statement cache).
type gcOutboxFixture struct {
	db     *pgtest.DB
	pool   *pgxpool.Pool
	rt     *rtcount.Counter
	sql    *sqlRecorder
	outbox *outbox.Outbox
	dedup  *idem.Dedup
	// ctx is the context the router gives a message (routerContext).
	ctx context.Context
}

func newGCOutboxFixture(t *testing.T, maxMessageBytes int) *gcOutboxFixture {
	return newOutboxFixture(t, maxMessageBytes, 1, &idem.GroupCommitConfig{MaxMessages: 64, MaxWait: time.Minute, Concurrency: 1})
}

// newOutboxFixture is a middleware in mode on a counted pool of conns
// connections, with an outbox of MaxMessageBytes maxMessageBytes.
func newOutboxFixture(t *testing.T, maxMessageBytes int, conns int32, mode idem.Mode) *gcOutboxFixture {
	t.Helper()
	ctx := context.Background()
	db := pgtest.New(t, 1)
	table := deduplicator.TableConfig{Schema: db.Schema}
	require.NoError(t, migrate.Up(ctx, db.Pool, deduplicator.MigrationLine(table)))
	db.Exec(t, "CREATE TABLE business (event_id uuid PRIMARY KEY)")
	ocfg := outbox.Config{Schema: db.Schema, Topics: []string{gcOutTopic}, MaxMessageBytes: maxMessageBytes}
	require.NoError(t, migrate.Up(ctx, db.Pool, outbox.MigrationLine(ocfg, gcOutTopic)))
	o, err := outbox.New(ocfg, nil)
	require.NoError(t, err)

	f := &gcOutboxFixture{db: db, rt: &rtcount.Counter{}, sql: &sqlRecorder{}, outbox: o, ctx: routerContext(t)}
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.MaxConns = conns
	cfg.ConnConfig.DialFunc = f.rt.DialFunc()
	cfg.ConnConfig.Tracer = f.sql
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	f.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(f.pool.Close)
	f.dedup, err = idem.NewDedup(idem.Config{DB: f.pool, ConsumerGroup: "g", Table: table, Outbox: o, Mode: mode}, nil)
	require.NoError(t, err)
	return f
}

// group runs msgs through h as ONE group: a blocker message holds the only
// slot until all of msgs have joined the open group. before runs once they
// have, before the blocker is released. It returns each message's error.
func (f *gcOutboxFixture) group(t *testing.T, h message.HandlerFunc, msgs []*message.Message, before func()) []error {
	t.Helper()
	blocker, release := publisher.NewEventID(), make(chan struct{})
	mw := f.dedup.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if id, _ := idem.EventIDFromContext(m.Context()); id == blocker {
			<-release
			return nil, nil
		}
		return h(m)
	})
	groups := f.dedup.Stats().Groups
	blocked := make(chan error, 1)
	for _, m := range msgs {
		m.SetContext(f.ctx)
	}
	go func() {
		_, err := mw(gcMsg(blocker))
		blocked <- err
	}()
	require.Eventually(t, func() bool { return f.dedup.Stats().Groups == groups+1 }, 30*time.Second, time.Millisecond, "the blocker's group holds the slot")
	var errs []error
	done := make(chan struct{})
	go func() { errs = deliverAll(mw, msgs); close(done) }()
	require.Eventually(t, func() bool { return idem.OpenGroupSize(f.dedup) == len(msgs) }, 30*time.Second, time.Millisecond, "the messages gather behind the blocker")
	if before != nil {
		before()
	}
	close(release)
	require.NoError(t, <-blocked)
	<-done
	return errs
}

func gcMsg(id uuid.UUID) *message.Message {
	m := message.NewMessage(uuid.NewString(), []byte(`{}`))
	m.Metadata.Set(publisher.MetadataEventID, id.String())
	return m
}

func gcMsgs(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = gcMsg(publisher.NewEventID())
	}
	return msgs
}

// routerContext returns the context a watermill router gives the messages
// of a handler publishing to gcOutTopic (the publish topic's key is
// watermill's own, unexported: a router run once hands it over), less the
// router's cancellation.
func routerContext(t *testing.T) context.Context {
	t.Helper()
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	got := make(chan context.Context, 1)
	router.AddHandler("capture", "capture-in", pubsub, gcOutTopic, pubsub, func(m *message.Message) ([]*message.Message, error) {
		select {
		case got <- context.WithoutCancel(m.Context()):
		default:
		}
		return nil, nil
	})
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	defer func() { require.NoError(t, router.Close()); require.NoError(t, pubsub.Close()) }()
	require.NoError(t, pubsub.Publish("capture-in", message.NewMessage(uuid.NewString(), nil)))
	ctx := <-got
	require.Equal(t, gcOutTopic, message.PublishTopicFromCtx(ctx))
	return ctx
}

// A group's outbox rows are ONE statement, whatever the number of members
// and however each wrote them: a member writing a business row, publishing
// one message with PublisherFromContext and returning another costs the
// group its business INSERT only; the group adds {BEGIN + claim}, one
// outbox INSERT and COMMIT. Counted at the net.Conn level, on a warm
// connection (each group size run once before).
func TestGroupCommit_OutboxRowsAreOneStatement(t *testing.T) {
	t.Parallel()
	f := newGCOutboxFixture(t, 0)
	h := (func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, "INSERT INTO business (event_id) VALUES ($1)", id); err != nil {
			return nil, err
		}
		pub, err := f.outbox.PublisherFromContext(ctx)
		if err != nil {
			return nil, err
		}
		if err := pub.Publish(gcOutTopic, message.NewMessage(uuid.NewString(), []byte(`{"published":1}`))); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte(`{"returned":1}`))}, nil
	})
	insert := f.insertSQL()
	for _, k := range []int{2, 7} {
		for _, measured := range []bool{false, true} {
			var rts int64
			errs := f.group(t, h, gcMsgs(k), func() { f.rt.Reset(); f.sql.reset() })
			rts = f.rt.Load()
			for _, err := range errs {
				require.NoError(t, err)
			}
			if !measured {
				continue
			}
			require.Equal(t, 1, f.sql.prefixed(insert), "k=%d: the group's outbox rows in one INSERT", k)
			require.EqualValues(t, k+4, rts, "k=%d: the blocker's COMMIT, then {BEGIN + claim}, %d business INSERTs, one outbox INSERT, COMMIT", k, k)
		}
	}
	require.Equal(t, 4*(2+7)*2/2, f.db.Count(t, "SELECT 1 FROM "+f.outbox.MessagesTable(gcOutTopic)), "two rows per message")
}

// Per key, the rows follow the order the group's handlers ran in, whichever
// way each member wrote them: a member's published message, then its
// returned one, then the next member's. Before the group gathered its rows,
// the returned messages were inserted at the COMMIT, after every later
// member's published ones.
func TestGroupCommit_OutboxRowsKeepTheMembersOrderPerKey(t *testing.T) {
	t.Parallel()
	f := newGCOutboxFixture(t, 0)
	var mu sync.Mutex
	var ran []string // the handlers' event ids, in the order they ran
	h := (func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		mu.Lock()
		ran = append(ran, id.String())
		mu.Unlock()
		ev := func(step string) *message.Message {
			e := message.NewMessage(uuid.NewString(), []byte(`{}`))
			e.Metadata.Set("member", id.String())
			e.Metadata.Set("step", step)
			return publisher.WithPartitionKey(e, "order-1")
		}
		pub, err := f.outbox.PublisherFromContext(ctx)
		if err != nil {
			return nil, err
		}
		if err := pub.Publish(gcOutTopic, ev("1 published")); err != nil {
			return nil, err
		}
		// A publisher on the transaction, with a message of its own context
		// (no handler context): it joins the group's rows all the same.
		if err := f.outbox.Publisher(idem.MustTxFromContext(ctx)).Publish(gcOutTopic, ev("2 on the tx")); err != nil {
			return nil, err
		}
		return []*message.Message{ev("3 returned")}, nil
	})
	for _, err := range f.group(t, h, gcMsgs(5), nil) {
		require.NoError(t, err)
	}
	rows, err := f.db.Pool.Query(context.Background(), `SELECT metadata->>'member', metadata->>'step' FROM `+f.outbox.MessagesTable(gcOutTopic)+` WHERE metadata->>'partition_key' = 'order-1' ORDER BY "offset"`)
	require.NoError(t, err)
	var got, want []string
	for rows.Next() {
		var member, step string
		require.NoError(t, rows.Scan(&member, &step))
		got = append(got, member+" "+step)
	}
	require.NoError(t, rows.Err())
	for _, id := range ran {
		for _, step := range []string{"1 published", "2 on the tx", "3 returned"} {
			want = append(want, id+" "+step)
		}
	}
	require.Len(t, ran, 5)
	require.Equal(t, want, got)
}

// A member whose returned message is over Config.MaxMessageBytes gets the
// outbox's typed error (a *outbox.RowError, permanent: the poison queue),
// and only it: it goes alone, the others commit as a group, and nothing of
// its own is written. Before, the group's outbox write failed at the COMMIT
// and sent every member alone.
func TestGroupCommit_OversizeMemberGetsTheTypedErrorAlone(t *testing.T) {
	t.Parallel()
	f := newGCOutboxFixture(t, 2048)
	msgs := gcMsgs(5)
	big := msgs[2].UUID
	h := (func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		if _, err := idem.MustTxFromContext(ctx).Exec(ctx, "INSERT INTO business (event_id) VALUES ($1)", id); err != nil {
			return nil, err
		}
		payload := []byte(`{}`)
		if m.UUID == big {
			payload = make([]byte, 4096)
		}
		return []*message.Message{message.NewMessage(uuid.NewString(), payload)}, nil
	})
	errs := f.group(t, h, msgs, nil)
	for i, err := range errs {
		if i != 2 {
			require.NoError(t, err, "member %d", i)
			continue
		}
		var re *outbox.RowError
		require.ErrorAs(t, err, &re)
		require.ErrorIs(t, err, publisher.ErrMessageTooLarge)
		require.True(t, idem.IsPermanent(err), "%v", err)
	}
	st := f.dedup.Stats()
	require.EqualValues(t, 1, st.Alone, "only the oversize member goes alone")
	require.Equal(t, 4, f.db.Count(t, "SELECT 1 FROM business"), "the oversize member's business row is rolled back")
	require.Equal(t, 4, f.db.Count(t, "SELECT 1 FROM "+f.outbox.MessagesTable(gcOutTopic)), "one row per other member, none of the oversize one")
	require.Equal(t, strconv.Itoa(5), strconv.Itoa(f.db.Count(t, "SELECT 1 FROM processed_event")), "the blocker's and the four members' claims")
}

// insertSQL is how the outbox's INSERT starts, as sqlRecorder records it.
func (f *gcOutboxFixture) insertSQL() string {
	return strings.ToLower("INSERT INTO " + f.outbox.MessagesTable(gcOutTopic))
}

// prefixed returns how many recorded statements start with prefix.
func (r *sqlRecorder) prefixed(prefix string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, s := range r.stmt {
		if strings.HasPrefix(s, prefix) {
			n++
		}
	}
	return n
}

// Lease mode's completion batch writes its members' outbox rows in one
// INSERT too: a first completion is paused until n more are queued behind
// it; they complete as one batch, each returning a message.
func TestLease_CompletionBatchOutboxRowsAreOneStatement(t *testing.T) {
	t.Parallel()
	f := newOutboxFixture(t, 0, 4, &idem.LeaseConfig{Concurrency: 1, FastPath: -1})
	const n = 6
	msgs := gcMsgs(n + 1)
	for _, m := range msgs {
		m.SetContext(f.ctx)
	}
	opener := msgs[0].UUID
	firstPaused, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	idem.SetLeaseHook(f.dedup, func(point string, _ uuid.UUID) {
		if point == "completing" {
			once.Do(func() {
				close(firstPaused)
				<-release
			})
		}
	})
	h := f.dedup.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if m.UUID != opener {
			<-firstPaused
		}
		return []*message.Message{message.NewMessage(uuid.NewString(), []byte(`{}`))}, nil
	})
	go func() {
		<-firstPaused
		for idem.LeaseCompletionsQueued(f.dedup) < n {
			time.Sleep(time.Millisecond)
		}
		f.sql.reset()
		close(release)
	}()
	for _, err := range deliverAll(h, msgs) {
		require.NoError(t, err)
	}
	require.Equal(t, n+1, f.db.Count(t, "SELECT 1 FROM "+f.outbox.MessagesTable(gcOutTopic)))
	require.Equal(t, 1, f.sql.prefixed(f.insertSQL()), "the batch of %d: one outbox INSERT (the opener's was before the reset)", n)
	require.Zero(t, f.dedup.Stats().GroupFallbacks)
}
