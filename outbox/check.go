package outbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/migtable"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Check verifies, for each topic (default: Config.Topics), that its
// messages table and its offsets table exist with the columns this package
// and the [Forwarder] use, and that every migration of the topic is
// recorded as applied. It only reads; run it at start-up when another
// process owns the migrations ([MigrationLine] and [NewForwarder] run it
// themselves). A table that fails returns a
// [*migrate.TableError]; a failing query returns its error, wrapped.
func (o *Outbox) Check(ctx context.Context, db migrate.Beginner, topics ...string) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox: check: begin: %w", err)
	}
	defer rollback(ctx, tx)
	if len(topics) == 0 {
		topics = o.cfg.Topics
	}
	return o.checkTopics(ctx, tx, topics)
}

func (o *Outbox) checkTopics(ctx context.Context, q dbx.Querier, topics []string) error {
	for _, topic := range topics {
		if err := o.checkShape(ctx, q, topic); err != nil {
			return err
		}
		pending, err := o.pendingVersions(ctx, q, topic)
		if err != nil {
			return err
		}
		if len(pending) > 0 {
			versions := make([]string, len(pending))
			for i, v := range pending {
				versions[i] = fmt.Sprint(v)
			}
			return &migrate.TableError{
				Component: "outbox: topic " + topic, Table: o.MessagesTable(topic), Err: migrate.ErrMigrationsPending,
				Problem: fmt.Sprintf("migration versions %s of component %s are not recorded in %s.%s", strings.Join(versions, ", "), o.componentKey(topic), o.cfg.Schema, migtable.Table),
				Fix:     "migrate outbox.MigrationLine(cfg, topic) up at start-up, which records tables of the right shape without changing them (a migrate.Migrator, or its rendered Migrations in your migration tool)",
			}
		}
	}
	return nil
}

// checkShape verifies that topic's two tables exist with the expected
// columns and keys.
func (o *Outbox) checkShape(ctx context.Context, q dbx.Querier, topic string) error {
	if err := o.cfg.validateTopic(topic); err != nil {
		return err
	}
	if err := o.checkTable(ctx, q, topic, false); err != nil {
		return err
	}
	return o.checkTable(ctx, q, topic, true)
}

// checkTable reads one table's columns (and, for an offsets table, whether
// consumer_group alone is unique) from the catalogs, names as parameters.
func (o *Outbox) checkTable(ctx context.Context, q dbx.Querier, topic string, offsets bool) error {
	name, quoted := o.cfg.TablePrefix+topic, o.MessagesTable(topic)
	if offsets {
		name, quoted = name+outboxsql.OffsetsSuffix, o.tables(topic).Offsets
	}
	fail := func(reason error, fix, format string, args ...any) error {
		return &migrate.TableError{Component: "outbox: topic " + topic, Table: quoted, Problem: fmt.Sprintf(format, args...), Fix: fix, Err: reason}
	}
	var (
		columns   map[string]string
		groupUniq bool
	)
	err := q.QueryRow(ctx, `SELECT
	(SELECT json_object_agg(a.attname, format_type(a.atttypid, a.atttypmod))
	   FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
	EXISTS (SELECT 1 FROM pg_catalog.pg_index i
	         JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
	        WHERE i.indrelid = c.oid AND i.indisunique AND i.indimmediate AND i.indnkeyatts = 1
	          AND i.indpred IS NULL AND a.attname = 'consumer_group')
FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')`, o.cfg.Schema, name).Scan(&columns, &groupUniq)
	if errors.Is(err, pgx.ErrNoRows) {
		return fail(ErrTopicNotMigrated, "migrate outbox.MigrationLine(cfg, topic) up at start-up", "does not exist")
	}
	if err != nil {
		return fmt.Errorf("outbox: check table %s: %w", quoted, err)
	}
	const fixShape = "let outbox.MigrationLine create the table (drop or rename this one once the forwarder has passed its rows)"
	want := map[string]string{"offset": "bigint", "uuid": "", "payload": strings.ToLower(o.cfg.PayloadType), "metadata": "", "transaction_id": "xid8"}
	if offsets {
		want = map[string]string{"consumer_group": "", "offset_acked": "bigint", "last_processed_transaction_id": "xid8"}
	}
	names := make([]string, 0, len(want))
	for c := range want {
		names = append(names, c)
	}
	slices.Sort(names)
	for _, c := range names {
		got, ok := columns[c]
		switch {
		case !ok:
			return fail(ErrTableShape, fixShape, "has no %s column", c)
		case want[c] != "" && got != want[c]:
			if c == "payload" {
				return fail(ErrTableShape, "set Config.PayloadType to the column's type, or migrate the table", "payload is %s but Config.PayloadType is %s", got, o.cfg.PayloadType)
			}
			return fail(ErrTableShape, fixShape, "column %s is %s, want %s", c, got, want[c])
		}
	}
	if offsets && !groupUniq {
		return fail(ErrTableShape, fixShape, "has no primary key or unique index on consumer_group alone, which the forwarder's position upsert (ON CONFLICT (consumer_group)) needs")
	}
	return nil
}
