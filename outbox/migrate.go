package outbox

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationTemplates holds the raw migration files of one topic's tables
// (NNN_name.up.sql and NNN_name.down.sql): text/template sources with
// {{ident ...}} placeholders for the schema and the table names. Use
// [Migrations] to get SQL ready for goose or golang-migrate.
var MigrationTemplates fs.FS = mustSub(migrationFiles, "migrations")

func mustSub(fsys fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(err)
	}
	return sub
}

// Component prefixes the key under which a topic's migrations are recorded
// in the schema's idem_schema_migration table: "outbox:" and the topic's
// messages table name (outbox:outbox_orders for topic orders and the
// default prefix).
const component = "outbox"

// ErrMigrationsPending is the reason of a [*TableError] for a topic whose
// tables exist but whose migrations are not all recorded in
// idem_schema_migration: tables made by an earlier release's unversioned
// Migrate (run the [Migrator] once: it records tables of the right shape as
// version 1 without changing them), or SQL applied without its record. It
// is the same error as deduplicator.ErrMigrationsPending (one migration
// engine, one answer to "is anything pending?").
var ErrMigrationsPending = deduplicator.ErrMigrationsPending

// Migrator creates, upgrades and downgrades the tables of the topics of one
// [Config]: for each topic its messages table and its offsets table, with
// embedded, versioned migrations recorded per topic in the schema's
// idem_schema_migration table (component outbox:<prefix><topic>), on the
// engine and migration table of [deduplicator.Migrator], with the same
// methods and the same types ([deduplicator.Direction],
// [deduplicator.MigrateOpts], [deduplicator.MigrateResult],
// [deduplicator.ValidateResult]), so one piece of code can drive both.
//
// [deduplicator.MigrateOpts.TargetVersion] applies to every topic; going
// down without it reverts the newest applied version of each topic, and -1
// drops the tables with the messages not yet forwarded.
//
// Every version of every topic runs in its own transaction that takes a
// per-schema advisory lock, so every instance of a service may migrate at
// start-up. Tables that an earlier release created without versions
// (CREATE TABLE IF NOT EXISTS) are adopted: version 1 leaves them as they
// are and is recorded only if they have watermill-sql v4's shape, else it
// returns a [*TableError] wrapping [ErrTableShape] and records nothing.
// A Migrator is safe for concurrent use.
type Migrator struct {
	db deduplicator.Beginner
	o  *Outbox
}

// migrator is the shape Migrator shares with deduplicator.Migrator.
type migrator interface {
	Migrate(context.Context, deduplicator.Direction, *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error)
	MigrateTx(context.Context, pgx.Tx, deduplicator.Direction, *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error)
	Validate(context.Context) (*deduplicator.ValidateResult, error)
	ValidateTx(context.Context, pgx.Tx) (*deduplicator.ValidateResult, error)
}

var (
	_ migrator = (*deduplicator.Migrator)(nil)
	_ migrator = (*Migrator)(nil)
)

// NewMigrator returns a Migrator of the tables of cfg.Topics (cfg is the
// same value as [New] gets: pass ob.Config()) on db, a *pgxpool.Pool, a
// *pgx.Conn or a pgx.Tx (each version then runs in a savepoint of it).
func NewMigrator(db deduplicator.Beginner, cfg Config) (*Migrator, error) {
	if db == nil {
		return nil, errors.New("outbox: NewMigrator: db is nil")
	}
	o, err := New(cfg, nil)
	if err != nil {
		return nil, err
	}
	return &Migrator{db: db, o: o}, nil
}

// Migrate migrates the tables of every topic in direction, topic by topic
// (backwards going down), each version in its own transaction, and returns
// the versions it applied or reverted. opts may be nil: up applies every
// pending version; down reverts only the newest applied version of each
// topic (set [deduplicator.MigrateOpts.TargetVersion]).
//
// Going up, existing tables of another shape than watermill-sql v4's are
// refused first, with a [*TableError] wrapping [ErrTableShape], and nothing
// changes. Once at the newest version it verifies the tables as
// [Outbox.Check] does. On error the result still lists the versions that ran before it:
// each version commits on its own, the failing one is rolled back.
func (m *Migrator) Migrate(ctx context.Context, direction deduplicator.Direction, opts *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error) {
	return m.migrate(ctx, m.db, direction, opts)
}

// MigrateTx is [Migrator.Migrate] on the caller's transaction: every
// version runs in a savepoint of tx, and nothing is visible to others, or
// kept, until tx commits. The migration lock is held until tx ends.
func (m *Migrator) MigrateTx(ctx context.Context, tx pgx.Tx, direction deduplicator.Direction, opts *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error) {
	return m.migrate(ctx, tx, direction, opts)
}

func (m *Migrator) migrate(ctx context.Context, db deduplicator.Beginner, direction deduplicator.Direction, opts *deduplicator.MigrateOpts) (*deduplicator.MigrateResult, error) {
	if opts == nil {
		opts = &deduplicator.MigrateOpts{}
	}
	res := &deduplicator.MigrateResult{Direction: direction, Versions: []deduplicator.MigrateVersion{}}
	lines, err := m.o.migrationLines(m.o.cfg.Topics)
	if err != nil {
		return res, err
	}
	if direction == deduplicator.DirectionUp {
		if err := m.o.checkBeforeMigrate(ctx, db); err != nil {
			return res, err
		}
	}
	steps, err := migrate.Migrate(ctx, db, m.o.cfg.Schema, migrate.Direction(direction), lines, migrate.Options{TargetVersion: opts.TargetVersion})
	for _, s := range steps {
		res.Versions = append(res.Versions, deduplicator.MigrateVersion(s))
	}
	if errors.Is(err, migrate.ErrUnknownVersion) {
		return res, fmt.Errorf("%w: %w", deduplicator.ErrUnknownVersion, err)
	}
	if err != nil {
		return res, fmt.Errorf("outbox: migrate %s: %w", direction, err)
	}
	if direction != deduplicator.DirectionUp || len(lines) == 0 || (opts.TargetVersion != 0 && opts.TargetVersion < lastVersion(lines[0])) {
		return res, nil
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("outbox: migrate: begin: %w", err)
	}
	defer rollback(ctx, tx)
	return res, m.o.checkTopics(ctx, tx, m.o.cfg.Topics)
}

// checkBeforeMigrate refuses, before anything changes, the existing tables
// of any topic that are not of the expected shape (a missing table is fine:
// the migration creates it). Version 1 checks again under the lock.
func (o *Outbox) checkBeforeMigrate(ctx context.Context, db deduplicator.Beginner) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox: migrate: begin: %w", err)
	}
	defer rollback(ctx, tx)
	for _, topic := range o.cfg.Topics {
		for _, offsets := range []bool{false, true} {
			if err := o.checkTable(ctx, tx, topic, offsets); err != nil && !errors.Is(err, ErrTopicNotMigrated) {
				return err
			}
		}
	}
	return nil
}

func lastVersion(l migrate.Line) int { return l.Migrations[len(l.Migrations)-1].Version }

// Validate reports the migrations not recorded as applied, reading
// idem_schema_migration in a transaction of its own. [Outbox.Check] and
// [NewForwarder] run it besides verifying the tables themselves.
func (m *Migrator) Validate(ctx context.Context) (*deduplicator.ValidateResult, error) {
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("outbox: validate: begin: %w", err)
	}
	defer rollback(ctx, tx)
	return m.ValidateTx(ctx, tx)
}

// ValidateTx is [Migrator.Validate] on the caller's transaction.
func (m *Migrator) ValidateTx(ctx context.Context, tx pgx.Tx) (*deduplicator.ValidateResult, error) {
	res := &deduplicator.ValidateResult{Pending: []deduplicator.Migration{}}
	for _, topic := range m.o.cfg.Topics {
		pending, err := m.o.pendingMigrations(ctx, tx, topic)
		if err != nil {
			return nil, err
		}
		res.Pending = append(res.Pending, pending...)
	}
	res.OK = len(res.Pending) == 0
	return res, nil
}

// Migrations returns the migrations of the tables of cfg.Topics, topic by
// topic, oldest first, rendered for cfg's schema, prefix and payload type:
// write each Up/Down to files to manage the schema with an external tool
// instead of a [Migrator]. deduplicator.Migrations renders the dedup
// tables the same way.
//
// Each Up ends by recording its version in the schema's
// idem_schema_migration table (created if missing), and each Down by
// deleting that record, as [Migrator.Migrate] does: [Outbox.Check] and
// [NewForwarder] refuse tables whose migrations are not recorded, and a
// Migrator applies nothing that is recorded.
func Migrations(cfg Config) ([]deduplicator.Migration, error) {
	o, err := New(cfg, nil)
	if err != nil {
		return nil, err
	}
	var out []deduplicator.Migration
	for _, topic := range o.cfg.Topics {
		migs, err := o.topicMigrations(topic)
		if err != nil {
			return nil, err
		}
		for _, m := range migs {
			r, err := o.render(topic, m)
			if err != nil {
				return nil, err
			}
			out = append(out, r)
		}
	}
	return out, nil
}

// Migrate creates or upgrades the tables of Config.Topics to the newest
// version: NewMigrator(db, o.Config()) then Migrate(ctx, DirectionUp, nil),
// for start-up. Use a [Migrator] to learn which versions were applied, to
// migrate down, or to migrate on your own transaction. watermill-sql cannot
// create tables inside a caller's transaction that writes messages.
func (o *Outbox) Migrate(ctx context.Context, db deduplicator.Beginner) error {
	m, err := NewMigrator(db, o.cfg)
	if err != nil {
		return err
	}
	if _, err := m.Migrate(ctx, deduplicator.DirectionUp, nil); err != nil {
		return err
	}
	o.logger.Debug("Outbox tables ready", watermill.LogFields{"topics": strings.Join(o.cfg.Topics, ","), "schema": o.cfg.Schema})
	return nil
}

// templateData is what the migration templates see.
type templateData struct {
	Schema, Messages, Offsets string
	// PayloadType is validated: BYTEA, JSON or JSONB.
	PayloadType string
	// InitLock is watermill-sql's schema initialisation lock of the
	// Outbox's SchemaAdapter.
	InitLock int
	// NotifyFunction and Trigger name the wake-up trigger of the messages
	// table and its function; ChannelLiteral is the channel it notifies,
	// as an SQL string literal.
	NotifyFunction, Trigger, ChannelLiteral string
}

// componentKey names topic's tables in the migration table.
func (o *Outbox) componentKey(topic string) string {
	return component + ":" + o.cfg.TablePrefix + topic
}

// topicMigrations renders the migrations of topic's tables.
func (o *Outbox) topicMigrations(topic string) ([]migrate.Migration, error) {
	if err := o.cfg.validateTopic(topic); err != nil {
		return nil, err
	}
	return migrate.Load(MigrationTemplates, templateData{
		Schema:      o.cfg.Schema,
		Messages:    o.cfg.TablePrefix + topic,
		Offsets:     o.cfg.TablePrefix + topic + offsetsSuffix,
		PayloadType: strings.ToUpper(o.cfg.PayloadType),
		InitLock:    o.schema.InitializeSchemaLock,
		// The messages table's name is at most 63-len("__offsets") bytes.
		NotifyFunction: o.cfg.TablePrefix + topic + "__notify",
		Trigger:        notifyTrigger,
		ChannelLiteral: "'" + strings.ReplaceAll(o.channel(topic), "'", "''") + "'",
	})
}

// migrationLines returns one line per topic; version 1 adopts existing
// tables only when checkShape passes, in the version's transaction.
func (o *Outbox) migrationLines(topics []string) ([]migrate.Line, error) {
	lines := make([]migrate.Line, 0, len(topics))
	for _, topic := range topics {
		migs, err := o.topicMigrations(topic)
		if err != nil {
			return nil, err
		}
		lines = append(lines, migrate.Line{
			Component:  o.componentKey(topic),
			Migrations: migs,
			// CREATE TABLE IF NOT EXISTS keeps a table of that name
			// whatever its shape: verify it before recording the version.
			Verify: func(ctx context.Context, tx pgx.Tx, _ migrate.Migration) error {
				return o.checkShape(ctx, tx, topic)
			},
		})
	}
	return lines, nil
}

// render adds to m the SQL that records it (Up) and forgets it (Down).
func (o *Outbox) render(topic string, m migrate.Migration) (deduplicator.Migration, error) {
	up, down, err := migrate.RecordSQL(o.cfg.Schema, o.componentKey(topic), m)
	if err != nil {
		return deduplicator.Migration{}, err
	}
	return deduplicator.Migration{
		Component: o.componentKey(topic),
		Version:   m.Version,
		Name:      m.Name,
		Up:        strings.TrimRight(m.Up, "\n") + "\n\n-- Recorded as applied, for outbox.Check.\n" + up,
		Down:      strings.TrimRight(m.Down, "\n") + "\n" + down,
	}, nil
}

// pendingMigrations returns the migrations of topic's tables not recorded
// as applied, rendered.
func (o *Outbox) pendingMigrations(ctx context.Context, q querier, topic string) ([]deduplicator.Migration, error) {
	migs, err := o.topicMigrations(topic)
	if err != nil {
		return nil, err
	}
	versions, err := migrate.Pending(ctx, q, o.cfg.Schema, o.componentKey(topic), migs)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege {
			return nil, fmt.Errorf("outbox: topic %s: cannot read %s.%s (GRANT SELECT on it to this role): %w", topic, o.cfg.Schema, migrate.Table, err)
		}
		return nil, fmt.Errorf("outbox: topic %s: %w", topic, err)
	}
	var pending []deduplicator.Migration
	for _, m := range migs {
		if slices.Contains(versions, m.Version) {
			r, err := o.render(topic, m)
			if err != nil {
				return nil, err
			}
			pending = append(pending, r)
		}
	}
	return pending, nil
}
