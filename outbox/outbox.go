package outbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Defaults.
const (
	// defaultSchema holds the outbox tables.
	defaultSchema = "public"
	// defaultTablePrefix prefixes the topic in the table names: the messages
	// of topic T live in outbox_T, the forwarders' positions in outbox_T__offsets.
	defaultTablePrefix = "outbox_"
	// defaultPayloadType is the payload column type: BYTEA stores any payload.
	defaultPayloadType = "BYTEA"
)

// maxTableName is PostgreSQL's identifier limit; longer names are silently
// truncated by the server, so two long topics could share a table.
const maxTableName = outboxsql.MaxTableName

// The errors of this package; match them with errors.Is.
var (
	// ErrTopicNotMigrated is returned when a topic's table does not exist:
	// add the topic to Config.Topics and migrate it at start-up
	// ([MigrationLine]).
	ErrTopicNotMigrated = errors.New("outbox: topic table does not exist; create it with its MigrationLine at start-up")
	// ErrInvalidTopic is returned for a topic that cannot name a table.
	ErrInvalidTopic = errors.New("invalid topic")
	// ErrTableShape is the reason of a [*migrate.TableError] for a table
	// that exists but is not what watermill-sql v4 creates: a missing
	// column, a transaction_id that is not xid8, a payload column of another
	// type than Config.PayloadType, or an offsets table without a unique key
	// on consumer_group alone.
	ErrTableShape = errors.New("outbox: table is not shaped as watermill-sql v4 creates it")
)

var topicRe = outboxsql.TopicRe

// Config configures an [Outbox].
type Config struct {
	// Schema is the PostgreSQL schema of the outbox tables. Defaults to
	// "public".
	Schema string
	// TablePrefix is prepended to the topic to name its table (watermill-sql's
	// one table per topic): prefix+topic holds the messages and
	// prefix+topic+"__offsets" the forwarders' positions. The whole name must
	// fit PostgreSQL's 63-byte limit. Defaults to "outbox_".
	TablePrefix string
	// Topics are the topics whose tables [MigrationLine]
	// creates, that [Outbox.Check] verifies, and that a [Forwarder] forwards
	// unless told otherwise. Defaults to none.
	Topics []string
	// PayloadType is the payload column type: BYTEA, JSON or JSONB. JSON
	// types refuse non-JSON payloads. Defaults to BYTEA.
	PayloadType string
	// MaxMessageBytes is the largest Kafka record, as Sarama counts it
	// against Producer.MaxMessageBytes, that a message may make: a write
	// of a larger one, or of one whose metadata holds watermill-kafka's
	// reserved UUID key, fails with a *[RowError] (permanent for the dedup
	// middleware: see publisher.ErrMessageTooLarge) and writes nothing.
	// The forwarder checks rows again with its own limit
	// (ForwarderConfig.MaxMessageBytes, this one by default). Set it to the
	// producer's. Negative: no size check. Defaults to 1 MiB, Sarama's
	// default.
	MaxMessageBytes int
}

func (c *Config) setDefaults() {
	if c.Schema == "" {
		c.Schema = defaultSchema
	}
	if c.TablePrefix == "" {
		c.TablePrefix = defaultTablePrefix
	}
	if c.PayloadType == "" {
		c.PayloadType = defaultPayloadType
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = defaultMaxMessageBytes
	}
}

// Validate reports the first invalid field, after applying the defaults to
// a copy (the zero Config is valid).
func (c Config) Validate() error {
	c.setDefaults()
	return c.validate()
}

func (c Config) validate() error {
	if err := ident.Validate("Schema", c.Schema); err != nil {
		return err
	}
	if err := ident.Validate("TablePrefix", c.TablePrefix); err != nil {
		return err
	}
	switch strings.ToUpper(c.PayloadType) {
	case "BYTEA", "JSON", "JSONB":
	default:
		return fmt.Errorf("PayloadType: %q must be BYTEA, JSON or JSONB", c.PayloadType)
	}
	for _, t := range c.Topics {
		if err := c.validateTopic(t); err != nil {
			return fmt.Errorf("Topics: %w", err)
		}
	}
	return nil
}

func (c Config) validateTopic(topic string) error {
	if !topicRe.MatchString(topic) {
		return fmt.Errorf("%w: %q (allowed: letters, digits and -$:._)", ErrInvalidTopic, topic)
	}
	if n := len(c.TablePrefix) + len(topic) + len(outboxsql.OffsetsSuffix); n > maxTableName {
		return fmt.Errorf("%w: %q makes a table name of %d bytes, over PostgreSQL's %d (shorten TablePrefix or the topic)", ErrInvalidTopic, topic, n, maxTableName)
	}
	return nil
}

// Outbox writes messages as rows of watermill-sql's PostgreSQL schema (one
// table per topic, with the writing transaction's id) inside the caller's
// transaction. It is safe for concurrent use.
type Outbox struct {
	cfg     Config
	schema  *wsql.DefaultPostgreSQLSchema
	offsets wsql.DefaultPostgreSQLOffsetsAdapter
	logger  watermill.LoggerAdapter
}

var _ interface {
	PublishInTx(ctx context.Context, tx pgx.Tx, topic string, msgs ...*message.Message) error
} = (*Outbox)(nil)

// New validates cfg and returns an Outbox. It does not touch the database
// (it has no connection: writes use the caller's transaction): call
// its [MigrationLine] at start-up, or [Outbox.Check] when
// another process owns the migrations, so that a missing table fails the
// start-up rather than the first message.
func New(cfg Config, logger watermill.LoggerAdapter) (*Outbox, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("outbox: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	cfg.Topics = append([]string(nil), cfg.Topics...)
	o := &Outbox{cfg: cfg, logger: logger}
	payloadType := strings.ToUpper(cfg.PayloadType)
	o.schema = &wsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: o.MessagesTable,
		GeneratePayloadType:       func(string) string { return payloadType },
		InitializeSchemaLock:      wsql.DefaultSchemaInitializationLock("idemkit_outbox"),
	}
	o.offsets = wsql.DefaultPostgreSQLOffsetsAdapter{GenerateMessagesOffsetsTableName: func(topic string) string { return o.tables(topic).Offsets }}
	return o, nil
}

// Config returns the configuration with defaults applied.
func (o *Outbox) Config() Config { return o.cfg }

// MessagesTable returns the quoted, schema-qualified table of topic.
func (o *Outbox) MessagesTable(topic string) string {
	return ident.Quote(o.cfg.Schema, o.cfg.TablePrefix+topic)
}

// notifyTrigger names the trigger of every messages table that notifies
// the topic's channel (migration 2).
const notifyTrigger = "idem_outbox_notify"

// channel is the NOTIFY channel of topic's table: the schema-qualified
// table name, or a digest of it when that is longer than a channel name
// may be (63 bytes). Two tables sharing a channel would only wake each
// other's forwarders for nothing.
func (o *Outbox) channel(topic string) string {
	ch := o.cfg.Schema + "." + o.cfg.TablePrefix + topic
	if len(ch) > maxTableName {
		sum := sha256.Sum256([]byte(ch))
		ch = "idem_outbox_" + hex.EncodeToString(sum[:16])
	}
	return ch
}

// tables returns topic's tables (messages, offsets, dead rows) for the
// statements of outboxsql.
func (o *Outbox) tables(topic string) outboxsql.Tables {
	return outboxsql.TopicTables(o.cfg.Schema, o.cfg.TablePrefix, topic)
}

func rollback(ctx context.Context, tx pgx.Tx) {
	_ = tx.Rollback(context.WithoutCancel(ctx)) // pgx.ErrTxClosed after a commit is expected
}

// PublishInTx stamps msgs ([publisher.Stamp] with ctx: inside a handler the
// causation and correlation ids come from the incoming event) and inserts
// them, in order, into topic's table on tx. They become visible to the
// forwarder only if tx commits. It implements the dedup middleware's
// OutboxWriter. If a message cannot be stamped, nothing is written. On a
// group-commit transaction the rows are inserted at the group's COMMIT, with
// the rest of the group's rows of the table (see [Outbox.Publisher]).
func (o *Outbox) PublishInTx(ctx context.Context, tx pgx.Tx, topic string, msgs ...*message.Message) error {
	return o.write(ctx, tx, topic, msgs, ctx)
}

// write is the one way into the outbox tables: it stamps every message
// ([publisher.Stamp] with stampCtx, or with the message's own context when
// stampCtx is nil), checks each against Config.MaxMessageBytes and, only if
// all passed, inserts them in order on tx as watermill-sql's publisher would
// (insertRows), with ctx. On a transaction whose hooks gather (the dedup
// middleware's group commit: idemctx.Hooks.Gather) the rows join the
// table's batch instead, inserted in one statement before the COMMIT
// (rowBatch), after the rows of earlier writes.
func (o *Outbox) write(ctx context.Context, tx execer, topic string, msgs []*message.Message, stampCtx context.Context) error {
	if len(msgs) == 0 {
		return nil
	}
	if err := o.cfg.validateTopic(topic); err != nil {
		return err
	}
	for _, msg := range msgs {
		sctx := stampCtx
		if sctx == nil {
			sctx = msg.Context()
		}
		if _, err := publisher.Stamp(sctx, msg); err != nil {
			return fmt.Errorf("outbox: %w", err)
		}
		// Stamp put sctx's trace in the metadata; a message without a
		// context of its own takes the write's (PublishInTx's ctx).
		otelx.Inject(ctx, msg)
		if err := checkRecord(msg, o.cfg.MaxMessageBytes); err != nil {
			return &RowError{Topic: topic, UUID: msg.UUID, Key: msg.Metadata.Get(publisher.MetadataPartitionKey), Size: recordBytes(msg), Err: err}
		}
	}
	table := o.MessagesTable(topic)
	ptx, isPgx := tx.(pgx.Tx)
	var hooks *idemctx.Hooks
	if isPgx {
		hooks = idemctx.HooksFor(ctx, ptx)
	}
	if b := hooks.BatchFor(ptx, table, func() idemctx.Batch { return &rowBatch{topic: topic, table: table} }); b != nil {
		if err := b.(*rowBatch).addRows(msgs); err != nil {
			return err
		}
	} else if err := o.insert(ctx, tx, topic, table, msgs); err != nil {
		return err
	}
	if _, nop := o.logger.(watermill.NopLogger); !nop {
		for _, msg := range msgs {
			o.logger.Trace("Message written to outbox", watermill.LogFields{"topic": topic, "message_uuid": msg.UUID, "event_id": msg.Metadata.Get(publisher.MetadataEventID)})
		}
	}
	// The rows are visible once tx commits. In a dedup handler the
	// middleware commits tx and then wakes this process's forwarders of the
	// table (wakers); on any other transaction they start looking now, the
	// COMMIT usually following within milliseconds.
	if !hooks.OnCommit(ptx, table, func() { wakers.wake(table) }) {
		wakers.wake(table)
	}
	return nil
}

// insert runs insertRows of msgs into topic's table on tx.
func (o *Outbox) insert(ctx context.Context, tx execer, topic, table string, msgs []*message.Message) error {
	args, err := insertArgs(msgs)
	if err != nil {
		return fmt.Errorf("outbox: insert into %s: %w", table, err)
	}
	return insertRows(ctx, tx, topic, table, len(msgs), args)
}

// rowBatch is the rows of one table gathered on a group-commit transaction
// (write), inserted in one statement by Flush, in the order they were
// written. Each row's arguments are encoded when it is written, its payload
// copied: a message changed after its write does not change its row.
type rowBatch struct {
	topic, table string
	n            int
	args         []any
}

func (b *rowBatch) addRows(msgs []*message.Message) error {
	args, err := insertArgs(msgs)
	if err != nil {
		return fmt.Errorf("outbox: insert into %s: %w", b.table, err)
	}
	for i := 1; i < len(args); i += 3 {
		args[i] = bytes.Clone(args[i].([]byte))
	}
	b.args = append(b.args, args...)
	b.n += len(msgs)
	return nil
}

// Queue adds the INSERT of the batch's rows, in one statement, to pb.
func (b *rowBatch) Queue(pb *pgx.Batch) {
	pb.Queue(insertQuery(b.table, b.n), b.args...).Fn = func(br pgx.BatchResults) error {
		_, err := br.Exec()
		return insertError(b.topic, b.table, err)
	}
}

// insertRows inserts n rows into topic's table in order, in one statement:
// the INSERT that watermill-sql's PostgreSQL schema adapter
// (wsql.DefaultPostgreSQLSchema.InsertQuery) builds, with the same
// arguments (insertArgs), run directly on tx with ctx.
func insertRows(ctx context.Context, tx execer, topic, table string, n int, args []any) error {
	_, err := tx.Exec(ctx, insertQuery(table, n), args...)
	return insertError(topic, table, err)
}

// insertError is the error of an INSERT into topic's table that failed
// with err (nil for nil).
func insertError(topic, table string, err error) error {
	switch {
	case err == nil:
		return nil
	case pgerr.Has(err, pgerrcode.UndefinedTable):
		return fmt.Errorf("%w: topic %q (table %s): %w", ErrTopicNotMigrated, topic, table, err)
	default:
		return fmt.Errorf("outbox: insert into %s: could not insert message as row: %w", table, err)
	}
}

// insertQuery is watermill-sql's INSERT of n rows into table.
func insertQuery(table string, n int) string {
	var q strings.Builder
	q.Grow(len(table) + 64 + 40*n)
	q.WriteString("INSERT INTO ")
	q.WriteString(table)
	q.WriteString(" (uuid, payload, metadata, transaction_id) VALUES ")
	for i := range n {
		if i > 0 {
			q.WriteByte(',')
		}
		p := 3*i + 1
		q.WriteString("($")
		q.WriteString(strconv.Itoa(p))
		q.WriteString(",$")
		q.WriteString(strconv.Itoa(p + 1))
		q.WriteString(",$")
		q.WriteString(strconv.Itoa(p + 2))
		q.WriteString(",pg_current_xact_id())")
	}
	return q.String()
}

// insertArgs are insertQuery's arguments for msgs.
func insertArgs(msgs []*message.Message) ([]any, error) {
	args := make([]any, 0, 3*len(msgs))
	for _, msg := range msgs {
		md, err := outboxsql.EncodeMetadata(msg.Metadata)
		if err != nil {
			return nil, fmt.Errorf("could not marshal metadata into JSON for message %s: %w", msg.UUID, err)
		}
		args = append(args, msg.UUID, []byte(msg.Payload), md)
	}
	return args, nil
}

// Publisher returns a message.Publisher that writes to the outbox on tx.
// Each message is stamped with its own context (set it to the handler
// message's context to get causation and correlation ids). Close is a
// no-op: tx belongs to the caller. On the transaction of a dedup
// middleware's group (group commit, lease mode's completion batch) the
// rows are checked and stamped at Publish, and inserted with the rest of
// the group's rows of the table, in one statement before its COMMIT.
func (o *Outbox) Publisher(tx pgx.Tx) message.Publisher {
	return &txPublisher{o: o, tx: tx}
}

// PublisherFromContext returns a Publisher bound to the transaction of the
// dedup middleware found in ctx (a handler's msg.Context()); messages get
// causation_id = the incoming event id. Outside such a handler it returns
// middleware.ErrNotInHandler.
func (o *Outbox) PublisherFromContext(ctx context.Context) (message.Publisher, error) {
	v := idemctx.From(ctx)
	if v == nil || v.Tx == nil {
		return nil, idemctx.ErrNotInHandler
	}
	return &txPublisher{o: o, tx: v.Tx, ctx: ctx}, nil
}

type txPublisher struct {
	o   *Outbox
	tx  pgx.Tx
	ctx context.Context // nil: each message's own context
}

func (p *txPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ctx := p.ctx
	if ctx == nil {
		ctx = msgs[0].Context()
	}
	return p.o.write(ctx, p.tx, topic, msgs, p.ctx)
}

func (p *txPublisher) Close() error { return nil }

// PoolPublisher returns a message.Publisher that opens its own transaction
// on db for every Publish call (all messages of one call commit together).
// Use it for events that are not part of a business transaction; for those
// that are, use [Outbox.Publisher] on that transaction.
func (o *Outbox) PoolPublisher(db migrate.Beginner) message.Publisher {
	return &poolPublisher{o: o, db: db}
}

type poolPublisher struct {
	o  *Outbox
	db migrate.Beginner
}

func (p *poolPublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ctx := msgs[0].Context()
	tx, err := p.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox: begin: %w", err)
	}
	defer rollback(ctx, tx)
	if err := p.o.write(ctx, tx, topic, msgs, nil); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("outbox: commit: %w", err)
	}
	wakers.wake(p.o.MessagesTable(topic))
	return nil
}

func (p *poolPublisher) Close() error { return nil }
