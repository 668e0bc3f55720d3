package outbox

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"time"

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
const Component = "outbox"

// ErrMigrationsPending is the reason of a [*TableError] for a topic whose
// tables exist but whose migrations are not all recorded in
// idem_schema_migration: tables made by an earlier release's unversioned
// Migrate (run the [Migrator] once: it records tables of the right shape as
// version 1 without changing them), or SQL applied without its record.
var ErrMigrationsPending = errors.New("outbox: topic migrations are pending")

// ErrUnknownVersion is returned going down when idem_schema_migration
// records a version of a topic's tables that the Migrator does not have (a
// newer release of this library applied it): migrate down with that
// release.
var ErrUnknownVersion = errors.New("outbox: idem_schema_migration records a version this Migrator does not know")

// Migration is one version of one topic's tables, rendered for the schema,
// the prefix and the payload type: write Up and Down to files for goose or
// golang-migrate.
type Migration struct {
	// Component is the key of the version's record in
	// idem_schema_migration: "outbox:" and the topic's messages table name.
	Component string
	// Topic whose tables it migrates.
	Topic   string
	Version int
	Name    string
	Up      string
	Down    string
}

// Direction is the way a [Migrator] migrates: [DirectionUp] or
// [DirectionDown].
type Direction string

// The directions of [Migrator.Migrate].
const (
	DirectionUp   Direction = "up"
	DirectionDown Direction = "down"
)

// MigrateOpts narrow [Migrator.Migrate]; nil is the zero value.
type MigrateOpts struct {
	// TargetVersion going up applies every topic's versions up to and
	// including it; going down it reverts each topic's versions above it,
	// newest first, and -1 reverts every version (the tables are dropped,
	// with the messages not yet forwarded). When set (> 0) it must be a
	// version of the topics' tables. Defaults to 0: up, every version; down,
	// only the newest applied version of each topic.
	TargetVersion int
}

// MigrateResult is what [Migrator.Migrate] did.
type MigrateResult struct {
	// Direction is the direction it migrated in.
	Direction Direction
	// Versions are the versions it applied (up) or reverted (down), in the
	// order it ran them; empty when there was nothing to do.
	Versions []MigrateVersion
}

// MigrateVersion is one version of one topic's tables, applied or reverted.
type MigrateVersion struct {
	// Component is the key of the version's record in idem_schema_migration.
	Component string
	// Version and Name are the migration's (001_topic_tables: 1, "topic_tables").
	Version int
	Name    string
	// Duration is how long its transaction took.
	Duration time.Duration
}

// ValidateResult is what [Migrator.Validate] found.
type ValidateResult struct {
	// OK is true when every migration of every topic is recorded as applied.
	OK bool
	// Pending are the migrations not recorded as applied, topic by topic,
	// oldest first, rendered as [Migrations] renders them.
	Pending []Migration
}

// Migrator creates, upgrades and downgrades the tables of the topics of one
// [Config]: for each topic its messages table and its offsets table, with
// embedded, versioned migrations recorded per topic in the schema's
// idem_schema_migration table (component outbox:<prefix><topic>), on the
// engine and migration table of deduplicator.Migrator.
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
// topic (set [MigrateOpts.TargetVersion]).
//
// Going up, existing tables of another shape than watermill-sql v4's are
// refused first, with a [*TableError] wrapping [ErrTableShape], and nothing
// changes. Once at the newest version it verifies the tables as
// [Outbox.Check] does. On error the result still lists the versions that ran before it:
// each version commits on its own, the failing one is rolled back.
func (m *Migrator) Migrate(ctx context.Context, direction Direction, opts *MigrateOpts) (*MigrateResult, error) {
	return m.migrate(ctx, m.db, direction, opts)
}

// MigrateTx is [Migrator.Migrate] on the caller's transaction: every
// version runs in a savepoint of tx, and nothing is visible to others, or
// kept, until tx commits. The migration lock is held until tx ends.
func (m *Migrator) MigrateTx(ctx context.Context, tx pgx.Tx, direction Direction, opts *MigrateOpts) (*MigrateResult, error) {
	return m.migrate(ctx, tx, direction, opts)
}

func (m *Migrator) migrate(ctx context.Context, db deduplicator.Beginner, direction Direction, opts *MigrateOpts) (*MigrateResult, error) {
	if opts == nil {
		opts = &MigrateOpts{}
	}
	res := &MigrateResult{Direction: direction, Versions: []MigrateVersion{}}
	lines, err := m.o.migrationLines(m.o.cfg.Topics)
	if err != nil {
		return res, err
	}
	if direction == DirectionUp {
		if err := m.o.checkBeforeMigrate(ctx, db); err != nil {
			return res, err
		}
	}
	steps, err := migrate.Migrate(ctx, db, m.o.cfg.Schema, migrate.Direction(direction), lines, migrate.Options{TargetVersion: opts.TargetVersion})
	for _, s := range steps {
		res.Versions = append(res.Versions, MigrateVersion(s))
	}
	if errors.Is(err, migrate.ErrUnknownVersion) {
		return res, fmt.Errorf("%w: %w", ErrUnknownVersion, err)
	}
	if err != nil {
		return res, fmt.Errorf("outbox: migrate %s: %w", direction, err)
	}
	if direction != DirectionUp || len(lines) == 0 || (opts.TargetVersion != 0 && opts.TargetVersion < lastVersion(lines[0])) {
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
func (m *Migrator) Validate(ctx context.Context) (*ValidateResult, error) {
	tx, err := m.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("outbox: validate: begin: %w", err)
	}
	defer rollback(ctx, tx)
	return m.ValidateTx(ctx, tx)
}

// ValidateTx is [Migrator.Validate] on the caller's transaction.
func (m *Migrator) ValidateTx(ctx context.Context, tx pgx.Tx) (*ValidateResult, error) {
	res := &ValidateResult{Pending: []Migration{}}
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
func Migrations(cfg Config) ([]Migration, error) {
	o, err := New(cfg, nil)
	if err != nil {
		return nil, err
	}
	var out []Migration
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
	if _, err := m.Migrate(ctx, DirectionUp, nil); err != nil {
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
}

// componentKey names topic's tables in the migration table.
func (o *Outbox) componentKey(topic string) string {
	return Component + ":" + o.cfg.TablePrefix + topic
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
func (o *Outbox) render(topic string, m migrate.Migration) (Migration, error) {
	up, down, err := migrate.RecordSQL(o.cfg.Schema, o.componentKey(topic), m)
	if err != nil {
		return Migration{}, err
	}
	return Migration{
		Component: o.componentKey(topic),
		Topic:     topic,
		Version:   m.Version,
		Name:      m.Name,
		Up:        strings.TrimRight(m.Up, "\n") + "\n\n-- Recorded as applied, for outbox.Check.\n" + up,
		Down:      strings.TrimRight(m.Down, "\n") + "\n" + down,
	}, nil
}

// pendingMigrations returns the migrations of topic's tables not recorded
// as applied, rendered.
func (o *Outbox) pendingMigrations(ctx context.Context, q querier, topic string) ([]Migration, error) {
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
	var pending []Migration
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
