package middleware_test

// Group commit and CompleteExec: the statements the group's handlers
// register go with the group's outbox rows, in one pipeline before the
// COMMIT, in the order registered; a failing one sends every member alone,
// where its statement runs at once and its error is the message's.

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// execHandler registers the member's business row with CompleteExec and
// returns one message for the outbox; ran gets the event ids in the order
// the handlers ran.
func execHandler(mu *sync.Mutex, ran *[]string) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		id, _ := idem.EventIDFromContext(ctx)
		mu.Lock()
		*ran = append(*ran, id.String())
		mu.Unlock()
		if err := idem.CompleteExec(ctx, "INSERT INTO business (event_id) VALUES ($1)", id); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(id.String(), []byte(`{}`))}, nil
	}
}

// A group's CompleteExec statements cost it no round trip of their own:
// {BEGIN + claims}, one pipeline (the k statements and the outbox INSERT),
// COMMIT, whatever k. With Exec on the transaction (the outbox test above)
// the same group takes k+3. Counted at the net.Conn level on a warm
// connection, with the blocker's COMMIT.
func TestGroupCommit_CompleteExecStatementsArePipelined(t *testing.T) {
	t.Parallel()
	f := newGCOutboxFixture(t, 0)
	f.db.Exec(t, "ALTER TABLE business ADD COLUMN seq bigint GENERATED ALWAYS AS IDENTITY")
	var mu sync.Mutex
	var ran []string
	h := execHandler(&mu, &ran)
	total := 0
	for _, k := range []int{2, 7} {
		for _, measured := range []bool{false, true} {
			errs := f.group(t, h, gcMsgs(k), func() { f.rt.Reset(); f.sql.reset() })
			rts := f.rt.Load()
			for _, err := range errs {
				require.NoError(t, err)
			}
			total += k
			if !measured {
				continue
			}
			require.EqualValues(t, 4, rts, "k=%d: the blocker's COMMIT, then {BEGIN + claims}, one pipeline of %d statements and the outbox INSERT, COMMIT", k, k)
			require.Equal(t, k, f.sql.prefixed("insert into business"), "k=%d: one statement per member", k)
		}
	}
	require.Equal(t, total, f.db.Count(t, "SELECT 1 FROM business"))
	require.Equal(t, total, f.db.Count(t, "SELECT 1 FROM "+f.outbox.MessagesTable(gcOutTopic)))
	// In the order registered: the rows' identity follows the handlers'.
	rows, err := f.db.Pool.Query(context.Background(), "SELECT event_id::text FROM business ORDER BY seq")
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, ran, got)
}

// A member whose gathered statement fails (its business row exists:
// unique_violation) fails the group's pipeline: the group is rolled back,
// every member goes alone, and the culprit's statement, run at once there,
// gives it its own error; the others commit, nothing of the culprit's
// (claim, outbox row) is written.
func TestGroupCommit_FailingCompleteExecGoesAlone(t *testing.T) {
	t.Parallel()
	f := newGCOutboxFixture(t, 0)
	msgs := gcMsgs(5)
	culprit, _ := publisher.EventIDFromMessage(msgs[2])
	f.db.Exec(t, "INSERT INTO business (event_id) VALUES ($1)", culprit)
	var mu sync.Mutex
	var ran []string
	errs := f.group(t, execHandler(&mu, &ran), msgs, nil)
	for i, err := range errs {
		if i != 2 {
			require.NoError(t, err, "member %d", i)
			continue
		}
		var pe *pgconn.PgError
		require.True(t, errors.As(err, &pe), "member 2: %v", err)
		require.Equal(t, pgerrcode.UniqueViolation, pe.Code)
	}
	st := f.dedup.Stats()
	require.EqualValues(t, 1, st.GroupFallbacks, "one rollback of the group")
	require.EqualValues(t, 5, st.Alone, "every member of the failed pipeline goes alone")
	require.Equal(t, 5, f.db.Count(t, "SELECT 1 FROM business"), "the four rows and the culprit's earlier one")
	require.Equal(t, 4, f.db.Count(t, "SELECT 1 FROM "+f.outbox.MessagesTable(gcOutTopic)), "no outbox row of the culprit's")
	require.Equal(t, 0, f.db.Count(t, "SELECT 1 FROM processed_event WHERE event_id = $1", culprit), "its claim rolled back: a redelivery runs it again")
}
