package retrytopic_test

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/publisher"
)

var errDownstream = errors.New("downstream unavailable")

// The proof: a downstream is down for one customer's events. Its
// events move to the retry topic, every other event keeps flowing (their
// partitions are not blocked), and once the downstream recovers the retried
// events succeed; every event is applied once.
func TestDownstreamDownForOneCustomer(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2, 2)
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) {
		c.MaxAttempts = 1000 // it keeps trying until the downstream is back
	}), nil)
	require.NoError(t, err)
	var down atomic.Bool
	down.Store(true)
	var failures atomic.Int32
	f.run(t, consumer{rt: rt, dedup: f.newDedup(t)}, func(ev event, _ bool) error {
		if ev.Key == "c0" && down.Load() {
			failures.Add(1)
			return fmt.Errorf("charge %s/%d: %w", ev.Key, ev.N, errDownstream)
		}
		return nil
	})
	poison := f.collect(t, f.poison)

	const perCustomer = 10
	for n := range perCustomer {
		for c := range 4 {
			f.publish(t, f.msg("c"+strconv.Itoa(c), n))
		}
	}

	// c1..c3 are applied while c0 is still failing, also those behind a c0
	// event in the same partition.
	eventually(t, func() bool { return f.rows(t, "key <> 'c0'") == 3*perCustomer },
		"the other customers' events are applied while c0's downstream is down")
	eventually(t, func() bool { return rt.Stats().Retried >= perCustomer },
		"every c0 event went to the retry topic")
	require.Zero(t, f.rows(t, "key = 'c0'"))
	require.Zero(t, poison.len())

	down.Store(false)
	eventually(t, func() bool { return f.rows(t, "key = 'c0'") == perCustomer }, "c0's events applied after recovery")
	f.eachAppliedOnce(t, 4*perCustomer)
	st := rt.Stats()
	require.EqualValues(t, perCustomer, st.Recovered, "each c0 event recovered once from the retry topic")
	require.Zero(t, st.Poisoned)
	require.Zero(t, poison.len())
	require.Positive(t, failures.Load())
}

// A transient failure that outlasts the last attempt is poisoned with the
// reason and the original topic (so a replay goes back there), after
// exactly MaxAttempts copies on the retry topic; a permanent error is
// poisoned at once, never retried; the retry copies keep the event id and
// record the original partition and offset.
func TestExhaustedAndPermanentGoToPoisonTopic(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 2, 1)
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) { c.MaxAttempts = 2 }), nil)
	require.NoError(t, err)
	var mu sync.Mutex
	runs := map[string][]string{} // key -> retry_attempt seen per run ("" on the main topic)
	poison := f.collect(t, f.poison)
	f.run(t, consumer{rt: rt, dedup: f.newDedup(t)}, func(ev event, onRetry bool) error {
		mu.Lock()
		defer mu.Unlock()
		runs[ev.Key] = append(runs[ev.Key], strconv.FormatBool(onRetry))
		switch ev.Key {
		case "flaky":
			return errDownstream
		case "bad":
			return idem.Permanent(errors.New("amount out of range"))
		}
		return nil
	})

	flaky, bad, good := f.msg("flaky", 1), f.msg("bad", 1), f.msg("good", 1)
	f.publish(t, flaky, bad, good)
	eventually(t, func() bool { return poison.len() == 2 && f.rows(t, "") == 1 }, "flaky and bad poisoned, good applied")

	got := poison.byEventID()
	pf := got[flaky.Metadata.Get(publisher.MetadataEventID)]
	require.NotNil(t, pf, "the flaky event was poisoned")
	reason := pf.Metadata.Get(wmiddleware.ReasonForPoisonedKey)
	require.Contains(t, reason, retrytopic.ErrAttemptsExhausted.Error())
	require.Contains(t, reason, errDownstream.Error())
	require.Equal(t, f.main, pf.Metadata.Get(wmiddleware.PoisonedTopicKey), "topic_poisoned is the original topic, not the retry topic")
	require.Equal(t, "ledger-retry-"+f.retry, pf.Metadata.Get(wmiddleware.PoisonedHandlerKey))
	require.Equal(t, "2", pf.Metadata.Get(retrytopic.MetadataAttempt))
	require.Equal(t, f.main, pf.Metadata.Get(retrytopic.MetadataOriginalTopic))
	require.NotEmpty(t, pf.Metadata.Get(retrytopic.MetadataOriginalPartition))
	require.NotEmpty(t, pf.Metadata.Get(retrytopic.MetadataOriginalOffset))
	require.Equal(t, flaky.UUID, pf.UUID)
	require.Equal(t, flaky.Payload, pf.Payload)

	pb := got[bad.Metadata.Get(publisher.MetadataEventID)]
	require.NotNil(t, pb, "the bad event was poisoned")
	require.Contains(t, pb.Metadata.Get(wmiddleware.ReasonForPoisonedKey), "amount out of range")
	require.Equal(t, f.main, pb.Metadata.Get(wmiddleware.PoisonedTopicKey))
	require.Equal(t, "ledger", pb.Metadata.Get(wmiddleware.PoisonedHandlerKey))
	require.Empty(t, pb.Metadata.Get(retrytopic.MetadataAttempt), "a permanent error never reaches a retry topic")

	mu.Lock()
	defer mu.Unlock()
	// flaky: main (2 in-process runs), attempt 1 (2), attempt 2 (2).
	require.Equal(t, []string{"false", "false", "true", "true", "true", "true"}, runs["flaky"])
	require.Equal(t, []string{"false"}, runs["bad"], "a permanent error is not retried in process either")
	st := rt.Stats()
	require.EqualValues(t, 2, st.Retried)
	require.EqualValues(t, 2, st.Poisoned)
	require.EqualValues(t, 1, st.Exhausted)
	require.Zero(t, st.Recovered)
	require.Equal(t, 1, f.rows(t, "key = 'good'"))
}

// A message on a retry topic without the retry headers (published there by
// hand, or by another tool) is poisoned with ErrInvalidHeaders, without
// running the handler; topic_poisoned falls back to the retry topic.
func TestRetryTopicMessageWithoutHeadersIsPoisoned(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1, 1)
	rt, err := retrytopic.New(f.retryConfig(nil), nil)
	require.NoError(t, err)
	var ran atomic.Int32
	poison := f.collect(t, f.poison)
	f.run(t, consumer{rt: rt, dedup: f.newDedup(t)}, func(event, bool) error { ran.Add(1); return nil })
	m := f.msg("k", 1)
	require.NoError(t, f.pub.Publish(f.retry, m))
	eventually(t, func() bool { return poison.len() == 1 }, "poisoned")
	p := poison.byEventID()[m.Metadata.Get(publisher.MetadataEventID)]
	require.NotNil(t, p)
	require.Contains(t, p.Metadata.Get(wmiddleware.ReasonForPoisonedKey), retrytopic.ErrInvalidHeaders.Error())
	require.Equal(t, f.retry, p.Metadata.Get(wmiddleware.PoisonedTopicKey))
	require.Zero(t, ran.Load())
	require.Zero(t, f.rows(t, ""))
}
