package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// migratingPublisher creates a topic's tables the first time it is used:
// the universal suite invents topic names, where a service lists its
// topics in Config.Topics and calls Migrate at start-up.
type migratingPublisher struct {
	message.Publisher
	o  *outbox.Outbox
	db migrate.Beginner

	mu   sync.Mutex
	done map[string]bool
}

func (p *migratingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	if !p.done[topic] {
		if err := migrateTopics(context.Background(), p.db, p.o, topic); err != nil {
			p.mu.Unlock()
			return err
		}
		p.done[topic] = true
	}
	p.mu.Unlock()
	return p.Publisher.Publish(topic, msgs...)
}

// closeWaitingSubscriber makes Close return only after every channel it
// handed out is closed. watermill-sql's Subscriber.Close waits for its
// consume goroutines but closes their channels just after, so the suite's
// non-blocking "channel closed after Close" check fails now and then on a
// loaded machine; that race is in the subscriber, not in what is tested here.
type closeWaitingSubscriber struct {
	*wsql.Subscriber
	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

func (s *closeWaitingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(out)
		for m := range in {
			select {
			case out <- m:
			case <-s.closing:
				return
			}
		}
	}()
	return out, nil
}

func (s *closeWaitingSubscriber) Close() error {
	err := s.Subscriber.Close()
	s.closeOnce.Do(func() { close(s.closing) })
	s.wg.Wait()
	return err
}

// TestPubSub runs Watermill's universal Pub/Sub suite on the outbox
// publisher (its own transaction per Publish) paired with a watermill-sql v4
// subscriber reading the same tables, through the Outbox's adapters.
//
// Not parallel with the other tests: a watermill-sql subscriber keeps its
// transaction (which has a transaction id, from its FOR UPDATE) open while
// a message waits to be read or acked, and until then every xmin-based
// reader on the server, the forwarders of the other tests included, waits
// behind it. AckDeadline bounds that wait.
func TestPubSub(t *testing.T) {
	db := pgtest.New(t, 24)
	o, err := outbox.New(outbox.Config{Schema: db.Schema}, watermill.NopLogger{})
	require.NoError(t, err)

	ackDeadline := 2 * time.Second
	constructor := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		pub := &migratingPublisher{Publisher: o.PoolPublisher(db.Pool), o: o, db: db.Pool, done: map[string]bool{}}
		sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(db.Pool), wsql.SubscriberConfig{
			ConsumerGroup:    group,
			SchemaAdapter:    schemaAdapter(o),
			OffsetsAdapter:   offsetsAdapter(o),
			InitializeSchema: true,
			PollInterval:     10 * time.Millisecond,
			ResendInterval:   10 * time.Millisecond,
			AckDeadline:      &ackDeadline,
		}, watermill.NopLogger{})
		require.NoError(t, err)
		wrapped := &closeWaitingSubscriber{Subscriber: sub, closing: make(chan struct{})}
		// Some of the suite's tests never close what they subscribed.
		t.Cleanup(func() { _ = wrapped.Close() })
		return pub, wrapped
	}
	tests.TestPubSub(t, tests.Features{
		ConsumerGroups:      true,
		ExactlyOnceDelivery: true,
		GuaranteedOrder:     true,
		Persistent:          true,
		// The suite's long variants publish thousands of messages per
		// subtest through a subscriber that hands out one row at a time;
		// under -race they exceed the package budget (10 minutes measured).
		// The short variants exercise the same behaviour with fewer
		// messages. The suite itself skips TestConcurrentClose and
		// TestContinueAfterSubscribeClose for exactly-once Pub/Subs (as for
		// watermill-sql's own run), TestReconnect without a restart command,
		// and TestNewSubscriberReceivesOldMessages: a consumer group's
		// position is kept in the offsets table, like Kafka's.
		ForceShort: true,
	}, func(t *testing.T) (message.Publisher, message.Subscriber) {
		return constructor(t, "test")
	}, constructor)
}
