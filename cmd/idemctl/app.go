package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/redact"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Exit codes.
const (
	exitOK = 0
	// exitFailure: the command failed (database unreachable, a query
	// failed, a table is missing...).
	exitFailure = 1
	// exitUsage: bad usage or bad input (unknown command or flag, malformed
	// event id, unknown consumer group or topic, a destructive command
	// without --yes). Nothing was changed.
	exitUsage = 2
	// exitNo: the command worked and the answer is no: dedup check found
	// the event not processed by (every) group.
	exitNo = 3
)

// exitError carries an exit code; err (if any) is printed on stderr.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("exit %d", e.code)
	}
	return e.err.Error()
}

func (e *exitError) Unwrap() error { return e.err }

// usageError is bad usage or input: exit code 2, and nothing changed.
func usageError(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

// options are the flags every command takes, before or after its name.
type options struct {
	databaseURL  string
	brokers      string
	schema       string
	table        string
	layout       string
	outboxSchema string
	outboxPrefix string
	topics       string
	json         bool
	kafka        kafkaSecurity
}

func defaultOptions() options {
	return options{
		schema:       "public",
		table:        "processed_event",
		layout:       "auto",
		outboxPrefix: "outbox_",
	}
}

// register adds the common flags to fs, each defaulting to its current
// value (so flags given before the command name are kept).
func (o *options) register(fs *flag.FlagSet) {
	fs.StringVar(&o.databaseURL, "database-url", o.databaseURL, "PostgreSQL connection `URL` (default $DATABASE_URL); prefer the variable: flags show in ps")
	fs.StringVar(&o.brokers, "brokers", o.brokers, "Kafka brokers, comma-separated `host:port` list (default $KAFKA_BROKERS); poison commands only")
	fs.StringVar(&o.schema, "schema", o.schema, "`schema` of the processed_event table (and of the outbox tables unless --outbox-schema)")
	fs.StringVar(&o.table, "table", o.table, "processed_event `table` name")
	fs.StringVar(&o.layout, "layout", o.layout, "table `layout`: auto (read it from the database), plain or partitioned")
	fs.StringVar(&o.outboxSchema, "outbox-schema", o.outboxSchema, "`schema` of the outbox tables (default: --schema)")
	fs.StringVar(&o.outboxPrefix, "outbox-prefix", o.outboxPrefix, "outbox table name `prefix` (messages of topic T in <prefix>T)")
	fs.StringVar(&o.topics, "topics", o.topics, "outbox `topics`, comma-separated (default: the topics recorded in idem_schema_migration)")
	fs.BoolVar(&o.json, "json", o.json, "print JSON for scripts instead of tables (errors too: {\"error\", \"code\"} on stdout)")
	o.kafka.register(fs)
}

// app is one run of the command.
type app struct {
	stdout, stderr *redact.Writer
	getenv         func(string) string
	opts           options
	path           string   // "idemctl dedup check", for messages
	cmd            *command // the leaf command running
	pool           *pgxpool.Pool
	printedJSON    bool     // printJSON wrote a document
	extraSecrets   []string // more to mask (serve's token)
}

func (a *app) close() {
	if a.pool != nil {
		a.pool.Close()
	}
}

// secrets returns what must never be printed: the database password (as
// configured and as written in the URL) and Kafka SASL passwords.
func (a *app) secrets() []string {
	var out []string
	for _, u := range []string{a.opts.databaseURL, a.getenv("DATABASE_URL")} {
		out = append(out, redact.URLSecrets(u)...)
	}
	if a.pool != nil && a.pool.Config().ConnConfig.Password != "" {
		out = append(out, a.pool.Config().ConnConfig.Password)
	}
	for _, k := range []string{"PGPASSWORD", "KAFKA_SASL_PASSWORD"} {
		if v := a.getenv(k); v != "" {
			out = append(out, v)
		}
	}
	out = append(out, a.extraSecrets...)
	for _, b := range strings.Split(a.opts.brokers+","+a.getenv("KAFKA_BROKERS"), ",") {
		out = append(out, redact.URLSecrets(b)...)
	}
	return out
}

// connect opens the pool once: --database-url, else $DATABASE_URL.
func (a *app) connect(ctx context.Context) (*pgxpool.Pool, error) {
	if a.pool != nil {
		return a.pool, nil
	}
	u := a.opts.databaseURL
	if u == "" {
		u = a.getenv("DATABASE_URL")
	}
	if u == "" {
		return nil, usageError("no database: set DATABASE_URL or pass --database-url")
	}
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return nil, usageError("invalid database URL: %v", err)
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "idemctl"
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	a.pool = pool
	if err := pool.Ping(ctx); err != nil {
		return nil, fmt.Errorf("cannot reach the database: %w", err)
	}
	return pool, nil
}

// tableConfig connects and returns the processed_event table named by the
// flags; with --layout auto its layout is read from the database (plain
// when the table does not exist yet and missingOK).
// tableOnly parses a command that takes only the common flags and returns
// its table, connected.
func (a *app) tableOnly(ctx context.Context, args []string) (deduplicator.TableConfig, error) {
	if _, err := a.parse(a.flags(), args); err != nil {
		return deduplicator.TableConfig{}, err
	}
	return a.tableConfig(ctx, false)
}

func (a *app) tableConfig(ctx context.Context, missingOK bool) (deduplicator.TableConfig, error) {
	tc := deduplicator.TableConfig{Schema: a.opts.schema, Table: a.opts.table}
	if err := tc.Validate(); err != nil {
		return tc, usageError("--schema/--table: %v", err)
	}
	pool, err := a.connect(ctx)
	if err != nil {
		return tc, err
	}
	return ops.ResolveTable(ctx, pool, a.opts.schema, a.opts.table, a.opts.layout, missingOK)
}

// outboxConfig is the outbox named by the flags; without --topics, the
// topics recorded in the outbox schema's idem_schema_migration when
// discover is true (none otherwise).
func (a *app) outboxConfig(ctx context.Context, discover bool) (outbox.Config, error) {
	cfg := outbox.Config{Schema: a.opts.outboxSchema, TablePrefix: a.opts.outboxPrefix}
	if cfg.Schema == "" {
		cfg.Schema = a.opts.schema
	}
	cfg.Topics = splitList(a.opts.topics)
	if err := cfg.Validate(); err != nil {
		return cfg, usageError("outbox flags: %v", err)
	}
	if len(cfg.Topics) > 0 || !discover {
		return cfg, nil
	}
	pool, err := a.connect(ctx)
	if err != nil {
		return cfg, err
	}
	topics, err := ops.RecordedTopics(ctx, pool, cfg)
	if err != nil {
		return cfg, err
	}
	cfg.Topics = topics
	return cfg, nil
}

// printJSON writes v as indented JSON.
func (a *app) printJSON(v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	a.printedJSON = true
	_, err = a.stdout.Write(append(b, '\n'))
	return err
}

// table returns a tabwriter on stdout; Flush it.
func (a *app) table() *tabwriter.Writer { return a.tableOn(a.stdout) }

func (a *app) tableOn(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

// row writes one tab-separated row.
func row(w io.Writer, cells ...any) {
	for i, c := range cells {
		if i > 0 {
			fmt.Fprint(w, "\t")
		}
		fmt.Fprint(w, c)
	}
	fmt.Fprintln(w)
}

// splitList splits a comma-separated flag value, dropping empty items.
func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
