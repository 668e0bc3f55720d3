package deduplicator

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/claimsql"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// TableConfig describes the processed_event table: its name, layout and
// retention. Build it once and give the same value to [MigrationLine], the
// middleware (idem.Config.Table) and the [Cleaner]. The zero value is valid:
// public.processed_event, plain layout, the recorded retention.
type TableConfig struct {
	// Schema holding the table. Must be a plain identifier. Defaults to "public".
	Schema string
	// Table name. Must be a plain identifier. Defaults to "processed_event".
	Table string
	// Layout of the table: [LayoutPlain] (delete old rows with a [Cleaner])
	// or [LayoutPartitioned] (daily partitions on event_id, dropped whole).
	// [MigrationLine] converts a plain table to the partitioned layout, keeping
	// every row. Defaults to LayoutPlain.
	Layout Layout
	// Retention is how long claims are kept. It has one source of truth:
	// the value recorded with the table. [MigrationLine] records it when it
	// creates the table (this field, or [DefaultRetention] when zero); the
	// middleware's stale guard and the [Cleaner] read it. A non-zero value
	// that differs from the recorded one is refused with
	// [ErrRetentionMismatch]: change it with idemctl retention set. Topics replayed
	// from a dead-letter queue need the longest replay delay plus a margin
	// (30 days is common). Defaults to 0: use the recorded retention.
	Retention time.Duration
}

func (c *TableConfig) setDefaults() {
	c.Schema, c.Table = claimsql.Names(c.Schema, c.Table)
}

// Validate reports the first invalid field, after applying the defaults to
// a copy (so the zero value is valid).
func (c TableConfig) Validate() error {
	c.setDefaults()
	return c.validate()
}

// maxTableLen keeps the companion tables' names (<table>_setting,
// <table>_group) within PostgreSQL's 63 bytes.
const maxTableLen = 63 - len(dedupsql.SettingSuffix)

func (c TableConfig) validate() error {
	if err := ident.Validate("Schema", c.Schema); err != nil {
		return err
	}
	if err := ident.Validate("Table", c.Table); err != nil {
		return err
	}
	if len(c.Table) > maxTableLen {
		return fmt.Errorf("Table: %q is longer than %d bytes, too long for its companion table %s%s", c.Table, maxTableLen, c.Table, dedupsql.SettingSuffix)
	}
	if c.Retention < 0 {
		return errors.New("Retention: must not be negative")
	}
	return c.Layout.validate(c.Table)
}

// Config configures a [Deduplicator].
type Config struct {
	TableConfig

	// ConsumerGroup is the second half of the dedup key: the same event is
	// applied once per group. Required; use the Kafka consumer group. A
	// name PostgreSQL cannot store (a NUL byte, invalid UTF-8) is refused
	// with an error wrapping [ErrInvalidGroupName].
	ConsumerGroup string

	// StaleMargin is subtracted from the table's retention when
	// [Deduplicator.CheckStale] decides that an event is stale. Defaults to
	// [DefaultStaleMargin] (1 hour); it must be shorter than the retention.
	StaleMargin time.Duration

	// ReplayHorizon is how far back the group's consumers may be replayed
	// (offset reset, DLQ replay). When it exceeds the retention minus
	// StaleMargin, Register logs it at Info level: events replayed from
	// further back will be refused as stale. Defaults to 0 (no check).
	ReplayHorizon time.Duration

	// NowFunc is the clock of the stale rule's cache: a horizon read at
	// NowFunc's t is re-read once [Deduplicator.CheckStale] is called with
	// a now at or past t + [RetentionRefreshInterval] (or before t). Give
	// CheckStale its now from the same clock. Defaults to time.Now.
	NowFunc func() time.Time
}

func (c *Config) setDefaults() {
	c.TableConfig.setDefaults()
	if c.StaleMargin == 0 {
		c.StaleMargin = DefaultStaleMargin
	}
	if c.NowFunc == nil {
		c.NowFunc = time.Now
	}
}

// Validate reports the first invalid field, after applying the defaults to
// a copy.
func (c Config) Validate() error {
	c.setDefaults()
	return c.validate()
}

func (c Config) validate() error {
	if c.ConsumerGroup == "" {
		return errors.New("ConsumerGroup: required (the dedup key is event id + consumer group)")
	}
	if err := ValidateGroupName("ConsumerGroup", c.ConsumerGroup); err != nil {
		return err
	}
	if c.StaleMargin < 0 {
		return errors.New("StaleMargin: must not be negative")
	}
	if c.Retention != 0 && c.StaleMargin >= c.Retention {
		return fmt.Errorf("StaleMargin: %s must be shorter than Retention (%s)", c.StaleMargin, c.Retention)
	}
	if c.ReplayHorizon < 0 {
		return errors.New("ReplayHorizon: must not be negative")
	}
	return c.TableConfig.validate()
}

// Retention and the stale rule.
const (
	// DefaultRetention is how long processed_event rows are kept: 7 days.
	// Topics replayed from a dead-letter queue need the longest replay
	// delay plus a margin (30 days is common).
	DefaultRetention = 7 * 24 * time.Hour
	// DefaultStaleMargin is [Config.StaleMargin]'s default: it covers clock
	// skew between producers, consumers and the Cleaner.
	DefaultStaleMargin = time.Hour
	// RetentionRefreshInterval is how often a running consumer re-reads the
	// table's recorded retention and cleanup horizon for
	// [Deduplicator.CheckStale]. A shortened retention takes effect for the
	// [Cleaner] twice this long after idemctl retention set changes it,
	// once every running consumer has re-read it.
	RetentionRefreshInterval = dedupsql.RefreshInterval
)
