package outboxsql

import (
	"context"
	"regexp"
	"strings"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/migtable"
)

// Component prefixes the key under which a topic's migrations are recorded
// in the schema's idem_schema_migration table: "outbox:" and the topic's
// messages table name (outbox:outbox_orders for topic orders and the
// default prefix).
const Component = "outbox"

// MaxTableName is PostgreSQL's identifier limit; longer names are silently
// truncated, so a topic whose tables' names exceed it is refused.
const MaxTableName = 63

// TopicRe matches the topic names the outbox accepts: letters, digits and
// -$:._ (a table name quoted as is).
var TopicRe = regexp.MustCompile(`^[A-Za-z0-9\-$:._]+$`)

// ValidTopic reports whether topic, with the tables' prefix, names tables
// PostgreSQL keeps as written.
func ValidTopic(prefix, topic string) bool {
	return TopicRe.MatchString(topic) && len(prefix)+len(topic)+len(OffsetsSuffix) <= MaxTableName
}

// RecordedTopics returns the topics whose tables idem_schema_migration (in
// schema) records a migration of under prefix, sorted: the topics migrated
// in that schema with that prefix, for tools that act on every topic
// (idemctl) without being told which. A topic's name is its component's
// (outbox:<prefix><topic>) after the prefix, so with the prefixes "outbox_"
// and "outbox_x_" in one schema the first also finds the second's topics
// (as x_<topic>). It only reads.
func RecordedTopics(ctx context.Context, db dbx.Querier, schema, prefix string) ([]string, error) {
	key := Component + ":" + prefix
	comps, err := migtable.Components(ctx, db, schema, key)
	if err != nil {
		return nil, err
	}
	topics := make([]string, 0, len(comps))
	for _, c := range comps {
		if topic := strings.TrimPrefix(c, key); ValidTopic(prefix, topic) {
			topics = append(topics, topic)
		}
	}
	return topics, nil
}
