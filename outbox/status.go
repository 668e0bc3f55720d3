package outbox

import (
	"context"
	"fmt"
	"strings"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Status lists, topic by topic, every version of the topic's tables, oldest
// first, as applied (with when) or pending, followed by the versions
// recorded for the topic that the migrator does not know (Unknown: a newer
// release's). It only reads, in a transaction of its own.
// [Migrator.Validate] is the shorter answer to "is anything pending?".
func (m *Migrator) Status(ctx context.Context) ([]deduplicator.MigrationStatus, error) {
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("outbox: migration status: begin: %w", err)
	}
	defer rollback(ctx, tx)
	out := []deduplicator.MigrationStatus{}
	for _, topic := range m.o.cfg.Topics {
		migs, err := m.o.topicMigrations(topic)
		if err != nil {
			return nil, err
		}
		vs, err := migrate.Status(ctx, tx, m.o.cfg.Schema, m.o.componentKey(topic), migs)
		if err != nil {
			return nil, fmt.Errorf("outbox: migration status of topic %s: %w", topic, err)
		}
		for _, v := range vs {
			out = append(out, deduplicator.MigrationStatus{Component: m.o.componentKey(topic), Version: v.Version, Name: v.Name, Applied: v.Applied, AppliedAt: v.AppliedAt, Unknown: v.Unknown})
		}
	}
	return out, nil
}

// RecordedTopics returns the topics whose tables idem_schema_migration (in
// cfg.Schema) records a migration of under cfg.TablePrefix, sorted: the
// topics a Migrator of that schema and prefix has migrated, for tools that
// act on every topic (idemctl) without being told which. A topic's name is
// its component's (outbox:<prefix><topic>) after the prefix, so with the
// prefixes "outbox_" and "outbox_x_" in one schema the first also finds the
// second's topics (as x_<topic>). It only reads.
func RecordedTopics(ctx context.Context, db deduplicator.DBTX, cfg Config) ([]string, error) {
	o, err := New(cfg, nil)
	if err != nil {
		return nil, err
	}
	prefix := o.componentKey("")
	comps, err := migrate.Components(ctx, db, o.cfg.Schema, prefix)
	if err != nil {
		return nil, fmt.Errorf("outbox: recorded topics: %w", err)
	}
	topics := make([]string, 0, len(comps))
	for _, c := range comps {
		topic := strings.TrimPrefix(c, prefix)
		if o.cfg.validateTopic(topic) == nil {
			topics = append(topics, topic)
		}
	}
	return topics, nil
}
