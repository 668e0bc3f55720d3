package outbox

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/migtable"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// component prefixes the key under which a topic's migrations are recorded
// in the schema's idem_schema_migration table: "outbox:" and the topic's
// messages table name (outbox:outbox_orders for topic orders and the
// default prefix).
const component = outboxsql.Component

// MigrationLine returns the migration line of topic's tables (its messages
// table and its offsets table, named by cfg, the value [New] gets) for a
// migrate.Migrator: its versions are recorded under the component
// outbox:<prefix><topic>. Give one line per topic.
//
// Going up, existing tables of another shape than watermill-sql v4's are
// refused before anything changes, with a [*migrate.TableError] wrapping
// [ErrTableShape]. Tables that watermill-sql created itself (its unversioned
// CREATE TABLE IF NOT EXISTS) are adopted: version 1 leaves them as they are
// and is recorded only if they have watermill-sql v4's shape. At the newest
// version the line verifies the tables as [Outbox.Check] does. Going down
// with TargetVersion -1 drops the tables with the messages not yet
// forwarded. An invalid cfg or topic is returned by migrate.New.
func MigrationLine(cfg Config, topic string) migrate.Line {
	o, err := New(cfg, nil)
	if err == nil {
		err = o.cfg.validateTopic(topic)
	}
	if err != nil {
		return migrate.Line{Component: component + ":" + cfg.TablePrefix + topic, Err: err}
	}
	return migrate.Line{
		Component: o.componentKey(topic),
		Schema:    o.cfg.Schema,
		Templates: []fs.FS{templates()},
		Data:      o.templateData(topic),
		BeforeUpFunc: func(ctx context.Context, tx pgx.Tx) error {
			for _, offsets := range []bool{false, true} {
				if err := o.checkTable(ctx, tx, topic, offsets); err != nil && !errors.Is(err, ErrTopicNotMigrated) {
					return err
				}
			}
			return nil
		},
		// CREATE TABLE IF NOT EXISTS keeps a table of that name whatever
		// its shape: verify it before recording the version.
		VerifyFunc: func(ctx context.Context, tx pgx.Tx, _ int) error {
			return o.checkShape(ctx, tx, topic)
		},
		CheckFunc: func(ctx context.Context, tx pgx.Tx) error {
			return o.checkTopics(ctx, tx, []string{topic})
		},
	}
}

func templates() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err)
	}
	return sub
}

// templateData is what the migration templates see.
type templateData struct {
	Schema, Messages, Offsets string
	// Dead holds the topic's poison rows (migration 4); DeadKeyIndex is
	// its index by partition key.
	Dead, DeadKeyIndex string
	// PayloadType is validated: BYTEA, JSON or JSONB.
	PayloadType string
	// InitLock is watermill-sql's schema initialisation lock of the
	// Outbox's schema adapter.
	InitLock int
	// NotifyFunction and Trigger name the wake-up trigger of the messages
	// table and its function; ChannelLiteral is the channel it notifies,
	// as an SQL string literal.
	NotifyFunction, Trigger, ChannelLiteral string
}

func (o *Outbox) templateData(topic string) templateData {
	return templateData{
		Schema:   o.cfg.Schema,
		Messages: o.cfg.TablePrefix + topic,
		Offsets:  o.cfg.TablePrefix + topic + outboxsql.OffsetsSuffix,
		// Both fit: the offsets table's suffix is longer.
		Dead:         o.cfg.TablePrefix + topic + outboxsql.DeadSuffix,
		DeadKeyIndex: o.cfg.TablePrefix + topic + "__dkey",
		PayloadType:  strings.ToUpper(o.cfg.PayloadType),
		InitLock:     o.schema.InitializeSchemaLock,
		// The messages table's name is at most 63-len("__offsets") bytes.
		NotifyFunction: o.cfg.TablePrefix + topic + "__notify",
		Trigger:        notifyTrigger,
		ChannelLiteral: "'" + strings.ReplaceAll(o.channel(topic), "'", "''") + "'",
	}
}

// componentKey names topic's tables in the migration table.
func (o *Outbox) componentKey(topic string) string {
	return component + ":" + o.cfg.TablePrefix + topic
}

// pendingVersions returns the versions of topic's tables not recorded as
// applied.
func (o *Outbox) pendingVersions(ctx context.Context, q dbx.Querier, topic string) ([]int, error) {
	vs, err := migtable.Load(o.templateData(topic), templates())
	if err != nil {
		return nil, err
	}
	versions, err := migtable.Pending(ctx, q, o.cfg.Schema, o.componentKey(topic), vs)
	if err != nil {
		if pgerr.Has(err, pgerrcode.InsufficientPrivilege) {
			return nil, fmt.Errorf("outbox: topic %s: cannot read %s.%s (GRANT SELECT on it to this role): %w", topic, o.cfg.Schema, migtable.Table, err)
		}
		return nil, fmt.Errorf("outbox: topic %s: %w", topic, err)
	}
	return versions, nil
}
