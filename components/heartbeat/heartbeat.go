package heartbeat

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/heartbeatsql"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
)

const (
	defaultSchema   = "public"
	defaultInterval = 5 * time.Second
	defaultKeep     = 2 * time.Hour
)

// Config configures a [Heartbeat].
type Config struct {
	// DB writes the samples (a *pgxpool.Pool). Required.
	DB migrate.DBTX
	// Schema holds the idem_heartbeat table. Defaults to "public".
	Schema string
	// Dedup is the middleware whose counters, consumer group and mode are
	// sent. Required.
	Dedup *idem.Dedup
	// Instance names this process on the console. Defaults to the host
	// name and the process id ("billing-7f9c-1"), as watermill's consumer
	// names go.
	Instance string
	// Version is the service's version. Defaults to the main module's
	// version from the build info ("(devel)" for a plain go build).
	Version string
	// Interval is the time between two samples. Defaults to 5 s.
	Interval time.Duration
	// Keep is how long samples are kept: each beat deletes older ones (of
	// every instance). Defaults to 2 hours.
	Keep time.Duration
	// Outbox, when set, adds its topics' pending rows
	// ((*outbox.Outbox).Backlog, one read per beat; DB must then also
	// begin transactions, as a *pgxpool.Pool does) to each sample: the
	// console draws the outbox backlog over time. Defaults to nil: none.
	Outbox *outbox.Outbox
}

func (c *Config) setDefaults() {
	if c.Schema == "" {
		c.Schema = defaultSchema
	}
	if c.Instance == "" {
		host, _ := os.Hostname()
		c.Instance = host + "-" + strconv.Itoa(os.Getpid())
	}
	if c.Version == "" {
		c.Version = "(devel)"
		if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
			c.Version = bi.Main.Version
		}
	}
	if c.Interval == 0 {
		c.Interval = defaultInterval
	}
	if c.Keep == 0 {
		c.Keep = defaultKeep
	}
}

// validate reports the first invalid field.
func (c Config) validate() error {
	switch {
	case c.DB == nil:
		return errors.New("DB: required")
	case c.Dedup == nil:
		return errors.New("Dedup: required")
	case c.Interval <= 0:
		return fmt.Errorf("Interval: %s must be positive", c.Interval)
	case c.Keep < c.Interval:
		return fmt.Errorf("Keep: %s must be at least Interval (%s)", c.Keep, c.Interval)
	}
	if _, ok := c.DB.(migrate.Beginner); c.Outbox != nil && !ok {
		return fmt.Errorf("DB: %T cannot begin the transaction Outbox's backlog is read in (use a *pgxpool.Pool)", c.DB)
	}
	return ident.Validate("Schema", c.Schema)
}

// MigrationLine returns the migration line of the heartbeat table in
// schema ("" for "public"), for a migrate.Migrator; its versions are
// recorded under the component idem_heartbeat.
func MigrationLine(schema string) migrate.Line {
	if schema == "" {
		schema = defaultSchema
	}
	line := migrate.Line{Component: heartbeatsql.Component, Schema: schema, Templates: []fs.FS{heartbeatsql.Migrations},
		Data: struct{ Schema string }{schema}}
	if err := ident.Validate("Schema", schema); err != nil {
		line.Err = fmt.Errorf("heartbeat: invalid config: %w", err)
	}
	return line
}

// Heartbeat writes the samples of one process.
type Heartbeat struct {
	cfg     Config
	logger  watermill.LoggerAdapter
	started time.Time
}

// New validates cfg and returns the heartbeat; nothing is written before
// [Heartbeat.Run].
func New(cfg Config, logger watermill.LoggerAdapter) (*Heartbeat, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("heartbeat: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Heartbeat{cfg: cfg, logger: logger, started: time.Now()}, nil
}

// Run writes a sample at once, then one every Interval, until ctx ends
// (then it returns nil). A failed write is logged and retried at the next
// beat: the heartbeat never stops the service.
func (h *Heartbeat) Run(ctx context.Context) error {
	t := time.NewTicker(h.cfg.Interval)
	defer t.Stop()
	for {
		if err := h.beat(ctx); err != nil && ctx.Err() == nil {
			h.logger.Error("Heartbeat not written", err, watermill.LogFields{"instance": h.cfg.Instance})
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (h *Heartbeat) beat(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, h.cfg.Interval)
	defer cancel()
	s := h.cfg.Dedup.Stats()
	var rejected uint64
	for _, n := range s.Rejected.ByReason() {
		rejected += n
	}
	sample := heartbeatsql.Sample{
		Instance: h.cfg.Instance, StartedAt: h.started, ConsumerGroup: h.cfg.Dedup.ConsumerGroup(),
		Mode: h.cfg.Dedup.Mode(), Version: h.cfg.Version,
		Processed: clamp(s.Processed), Duplicates: clamp(s.Duplicates), Failed: clamp(s.Failed), Rejected: clamp(rejected),
	}
	if h.cfg.Outbox != nil {
		bl, err := h.cfg.Outbox.Backlog(ctx, h.cfg.DB.(migrate.Beginner), nil)
		if err != nil {
			return fmt.Errorf("heartbeat: outbox backlog: %w", err)
		}
		var pending int64
		for _, b := range bl {
			pending += b.Pending
		}
		sample.OutboxBacklog = &pending
	}
	return heartbeatsql.Beat(ctx, h.cfg.DB, h.cfg.Schema, sample, h.cfg.Keep)
}

func clamp(n uint64) int64 { return int64(min(n, math.MaxInt64)) }
