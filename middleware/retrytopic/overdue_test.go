package retrytopic_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// errorLines keeps the Error lines of a logger.
type errorLines struct {
	watermill.NopLogger
	mu    sync.Mutex
	lines []watermill.LogFields
	errs  []error
}

func (l *errorLines) Error(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fields.Add(watermill.LogFields{"msg": msg}))
	l.errs = append(l.errs, err)
}

func (l *errorLines) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// A key whose first event's copy has been due for longer than OverdueAfter
// (its retry consumers stalled, as a consumer group that cannot rebalance
// does) is reported: Stats.OverdueKeys, and one log line naming the key,
// the event, the topic and the recovery. A key whose copy is due but not
// yet overdue is not.
func TestKeyOrderReportsAStalledRetryPath(t *testing.T) {
	t.Parallel()
	f := newFixture(t, 1, 1)
	ko := f.keyOrder(t)
	logs := &errorLines{}
	rt, err := retrytopic.New(f.retryConfig(func(c *retrytopic.Config) { c.KeyOrder = ko }), logs)
	require.NoError(t, err)

	stuck, late := f.msg("acct-42", 1), f.msg("acct-7", 1)
	table := pgx.Identifier{f.db.Schema, "retry_parked_key"}.Sanitize()
	f.db.Exec(t, `INSERT INTO `+table+` (consumer_group, partition_key, event_id, topic, not_before, message_uuid, payload, metadata) VALUES
($1, 'acct-42', $2, $4, now() - interval '10 minutes', 'm0', '{}', '{}'),
($1, 'acct-7', $3, $4, now() - interval '30 seconds', 'm1', '{}', '{}')`,
		f.group, stuck.Metadata.Get("event_id"), late.Metadata.Get("event_id"), f.retry)

	// Any message on its way through runs the check.
	other := f.msg("acct-1", 1)
	_, err = rt.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(other)
	require.NoError(t, err)

	require.Equal(t, uint64(1), rt.Stats().OverdueKeys)
	require.Len(t, logs.lines, 1)
	require.True(t, errors.Is(logs.errs[0], retrytopic.ErrHeadOverdue))
	line := logs.lines[0]
	require.Equal(t, "acct-42", line["key"])
	require.Equal(t, stuck.Metadata.Get("event_id"), line["head_event_id"])
	require.Equal(t, f.retry, line["retry_topic"])
	require.Contains(t, line["msg"], "idemctl retry unblock --group G --overdue")
}
