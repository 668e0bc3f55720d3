package deduplicator

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// Defaults.
const (
	DefaultSchema = "public"
	DefaultTable  = "processed_event"
)

// TableConfig names the processed_event table.
type TableConfig struct {
	// Schema holding the table. Must be a plain identifier. Defaults to "public".
	Schema string
	// Table name. Must be a plain identifier. Defaults to "processed_event".
	Table string
	// Layout of the table: [LayoutPlain] (delete old rows with a [Cleaner])
	// or [LayoutPartitioned] (daily partitions on event_id, dropped whole).
	// [Migrate] converts a plain table to the partitioned layout, keeping
	// every row. Defaults to LayoutPlain.
	Layout Layout
}

func (c *TableConfig) setDefaults() {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
}

// Validate checks that the names are plain SQL identifiers.
func (c TableConfig) Validate() error {
	return errors.Join(ident.Validate("Schema", c.Schema), ident.Validate("Table", c.Table), c.Layout.validate(c.Table))
}

// Config configures a [Deduplicator].
type Config struct {
	TableConfig

	// ConsumerGroup is the second half of the dedup key: the same event is
	// applied once per group. Required; use the Kafka consumer group.
	ConsumerGroup string
}

func (c *Config) setDefaults() {
	c.TableConfig.setDefaults()
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if c.ConsumerGroup == "" {
		return errors.New("ConsumerGroup: required (the dedup key is event id + consumer group)")
	}
	if err := c.TableConfig.Validate(); err != nil {
		return fmt.Errorf("TableConfig: %w", err)
	}
	return nil
}

// DefaultRetention is how long processed_event rows are kept: 7 days. Topics
// replayed from a dead-letter queue need the longest replay delay plus a margin
// (30 days is common).
const DefaultRetention = 7 * 24 * time.Hour
