package idemtest

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"

	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// RequireOutboxOpts narrows [RequireOutboxMessage]. A nil *RequireOutboxOpts
// matches any message of the topic.
type RequireOutboxOpts struct {
	// EventID, when not uuid.Nil, must equal the message's event_id metadata.
	EventID uuid.UUID
	// CausationID, when not uuid.Nil, must equal the causation_id metadata
	// (the event whose handler produced the message).
	CausationID uuid.UUID
	// Metadata entries must all be present with these values.
	Metadata map[string]string
	// Count is the exact number of matching messages expected. Defaults to
	// 0, meaning at least one.
	Count int
}

func (o *RequireOutboxOpts) matches(m *message.Message) bool {
	if o == nil {
		return true
	}
	if o.EventID != uuid.Nil && m.Metadata.Get(publisher.MetadataEventID) != o.EventID.String() {
		return false
	}
	if o.CausationID != uuid.Nil && m.Metadata.Get(publisher.MetadataCausationID) != o.CausationID.String() {
		return false
	}
	for k, v := range o.Metadata {
		if got, ok := m.Metadata[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// RequireOutboxMessage fails tb unless ob's table for topic holds a message
// matching opts (exactly opts.Count of them when set), and returns the
// matching messages in outbox order. db is a pool (committed messages) or
// the code under test's pgx.Tx (its uncommitted writes included). Forwarded
// rows stay in the table, so this also works after the forwarder ran.
func RequireOutboxMessage(ctx context.Context, tb testing.TB, db migrate.DBTX, ob *outbox.Outbox, topic string, opts *RequireOutboxOpts) []*message.Message {
	tb.Helper()
	all := outboxMessages(ctx, tb, db, ob, topic)
	var match []*message.Message
	for _, m := range all {
		if opts.matches(m) {
			match = append(match, m)
		}
	}
	want := 0
	if opts != nil {
		want = opts.Count
	}
	switch {
	case want == 0 && len(match) == 0:
		tb.Fatalf("idemtest: no outbox message for topic %q matches %s (%d messages in the topic)", topic, opts.describe(), len(all))
	case want > 0 && len(match) != want:
		tb.Fatalf("idemtest: %d outbox messages for topic %q match %s, want %d", len(match), topic, opts.describe(), want)
	}
	return match
}

// RequireNoOutboxMessage fails tb if ob's table for topic holds a message
// matching opts, as [RequireOutboxMessage] sees them.
func RequireNoOutboxMessage(ctx context.Context, tb testing.TB, db migrate.DBTX, ob *outbox.Outbox, topic string, opts *RequireOutboxOpts) {
	tb.Helper()
	n := 0
	for _, m := range outboxMessages(ctx, tb, db, ob, topic) {
		if opts.matches(m) {
			n++
		}
	}
	if n > 0 {
		tb.Fatalf("idemtest: %d outbox messages for topic %q match %s, want none", n, topic, opts.describe())
	}
}

func (o *RequireOutboxOpts) describe() string {
	if o == nil {
		return "{any}"
	}
	return fmt.Sprintf("{EventID:%s CausationID:%s Metadata:%v}", o.EventID, o.CausationID, o.Metadata)
}

func outboxMessages(ctx context.Context, tb testing.TB, db migrate.DBTX, ob *outbox.Outbox, topic string) []*message.Message {
	tb.Helper()
	if ob == nil {
		tb.Fatalf("idemtest: nil *outbox.Outbox")
	}
	if _, err := outbox.New(outbox.Config{Schema: ob.Config().Schema, TablePrefix: ob.Config().TablePrefix, Topics: []string{topic}}, nil); err != nil {
		tb.Fatalf("idemtest: %v", err)
	}
	rows, err := outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, topic).ReadAll(ctx, db)
	if err != nil {
		if pgerr.Has(err, pgerrcode.UndefinedTable) {
			tb.Fatalf("idemtest: the outbox has no table for topic %q (%s): migrate it first", topic, ob.MessagesTable(topic))
		}
		tb.Fatalf("idemtest: read outbox %s: %v", ob.MessagesTable(topic), err)
	}
	msgs := make([]*message.Message, len(rows))
	for i, r := range rows {
		if msgs[i], err = r.Message(); err != nil {
			tb.Fatalf("idemtest: read outbox %s: %v", ob.MessagesTable(topic), err)
		}
	}
	return msgs
}
