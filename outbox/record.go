package outbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/otelx"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// batch is one page ready to send: its messages in order, and with a
// Producer their Kafka records (then msgs may be nil: see readPage).
type batch struct {
	msgs    []*message.Message
	records []*sarama.ProducerMessage
}

// size is the number of messages of b.
func (b *batch) size() int { return max(len(b.msgs), len(b.records)) }

// readPage reads the rows of page, in order, and with a Producer marshals
// them: this runs while the previous page is being sent. With the default
// Marshaler and no tracing, a row whose metadata is the compact JSON
// watermill-sql writes becomes its record directly (fastRecord), without a
// Watermill message in between.
//
// A row that cannot be sent (its record is over MaxMessageBytes, its
// metadata is unreadable or holds a reserved key) is quarantined: moved, on
// tx, to the topic's dead table with its cause, and its key joins dead. A
// row whose key is in dead (a poison row of the key came before it) is
// moved there too, held behind it, so that the key's order is kept when an
// operator retries the key. Neither is sent.
func (f *Forwarder) readPage(ctx context.Context, tx dbx.Querier, tables outboxsql.Tables, topic string, page outboxsql.Page, dead map[string]int64, logger watermill.LoggerAdapter) (*batch, error) {
	rows, err := tables.ReadPage(ctx, tx, page, make([]outboxsql.Row, 0, page.Rows))
	if err != nil {
		return nil, fmt.Errorf("read page: %w", err)
	}
	return f.makeBatch(ctx, tx, tables, topic, rows, dead, logger)
}

// makeBatch makes a page's rows, read in order, into a batch, quarantining
// those that cannot be sent (see readPage).
func (f *Forwarder) makeBatch(ctx context.Context, tx dbx.Querier, tables outboxsql.Tables, topic string, rows []outboxsql.Row, dead map[string]int64, logger watermill.LoggerAdapter) (*batch, error) {
	b := &batch{}
	_, defaultMarshaler := f.cfg.Marshaler.(idemkafka.Marshaler)
	fast := f.cfg.Producer != nil && defaultMarshaler && f.tracing.Tracer() == nil
	if fast {
		b.records = make([]*sarama.ProducerMessage, 0, len(rows))
	} else {
		b.msgs = make([]*message.Message, 0, len(rows))
		if f.cfg.Producer != nil {
			b.records = make([]*sarama.ProducerMessage, 0, len(rows))
		}
	}
	for _, r := range rows {
		var (
			pm    *sarama.ProducerMessage
			msg   *message.Message
			key   string
			size  int
			cause error
		)
		if fast {
			if rec, ok := fastRecord(topic, r); ok {
				pm = rec
				if rec.Key != nil {
					key = string(rec.Key.(sarama.StringEncoder))
				}
			}
		}
		if pm == nil {
			if msg, cause = r.Message(); cause == nil {
				key = msg.Metadata.Get(publisher.MetadataPartitionKey)
				if cause = checkRecord(msg, 0); cause == nil && f.cfg.Producer != nil {
					if pm, cause = f.cfg.Marshaler.Marshal(topic, msg); cause != nil {
						cause = fmt.Errorf("marshal: %w", cause)
					}
				}
				if pm == nil && cause == nil {
					size = recordBytes(msg)
				}
			}
		}
		if pm != nil {
			size = pm.ByteSize(2)
		}
		if cause == nil && f.cfg.MaxMessageBytes > 0 && size > f.cfg.MaxMessageBytes {
			cause = fmt.Errorf("%w: %d bytes > MaxMessageBytes %d", publisher.ErrMessageTooLarge, size, f.cfg.MaxMessageBytes)
		}
		held, isHeld := dead[key]
		isHeld = isHeld && key != ""
		if cause == nil && !isHeld {
			if fast {
				b.records = append(b.records, pm)
			} else {
				b.msgs = append(b.msgs, msg)
				if f.cfg.Producer != nil {
					b.records = append(b.records, pm)
				}
			}
			continue
		}
		if err := f.quarantine(ctx, tx, tables, topic, r, key, size, cause, held, dead, logger); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// quarantine moves row r to the dead table: as a poison row (cause) whose
// key then holds its later rows, or as a row held behind the dead row held.
func (f *Forwarder) quarantine(ctx context.Context, tx dbx.Querier, tables outboxsql.Tables, topic string, r outboxsql.Row,
	key string, size int, cause error, held int64, dead map[string]int64, logger watermill.LoggerAdapter) error {
	text := ""
	if cause != nil {
		text, held = cause.Error(), 0
	} else {
		text = "held behind dead row " + strconv.FormatInt(held, 10) + " of its partition key"
	}
	id, err := tables.Quarantine(ctx, tx, r, key, text, held, size)
	if err != nil {
		return fmt.Errorf("quarantine row %d: %w", r.Offset, err)
	}
	if id == 0 {
		return nil // deleted meanwhile
	}
	f.quarantined.Add(1)
	fields := watermill.LogFields{"topic": topic, "offset": r.Offset, "message_uuid": r.UUID, "partition_key": key, "size": size, "dead_id": id}
	if cause != nil {
		if key != "" {
			dead[key] = id
		}
		fields["max_message_bytes"] = f.cfg.MaxMessageBytes
		logger.Error("Outbox row cannot be sent: moved to the dead table, its key's later rows wait behind it (idemctl outbox dead)", &RowError{Topic: topic, Offset: r.Offset, UUID: r.UUID, Key: key, Size: size, Err: cause}, fields)
	} else {
		fields["held_behind"] = held
		logger.Info("Outbox row held behind a dead row of its key: moved to the dead table", fields)
	}
	return nil
}

// uuidHeaderKey is watermill-kafka's header of the message UUID.
var uuidHeaderKey = []byte(kafka.UUIDHeaderKey)

// fastRecord returns the record idemkafka.Marshaler makes of row's message
// (the UUID header, one header per metadata entry, key = partition_key),
// built from the row's bytes, or false when row's metadata is not the
// compact, escape-free JSON object of distinct keys FlatPairs reads, or
// holds watermill-kafka's reserved UUID key: the caller then goes the
// long way, which decodes anything and reports the reserved key.
func fastRecord(topic string, row outboxsql.Row) (*sarama.ProducerMessage, bool) {
	headers := make([]sarama.RecordHeader, 1, 10)
	headers[0] = sarama.RecordHeader{Key: uuidHeaderKey, Value: []byte(row.UUID)}
	var key []byte
	if row.Metadata != nil {
		ok := outboxsql.FlatPairs(row.Metadata, func(k, v []byte) {
			headers = append(headers, sarama.RecordHeader{Key: k, Value: v})
			if string(k) == publisher.MetadataPartitionKey {
				key = v
			}
		})
		if !ok {
			return nil, false
		}
		for i := 1; i < len(headers); i++ {
			if bytes.Equal(headers[i].Key, uuidHeaderKey) {
				return nil, false
			}
			for j := 1; j < i; j++ {
				if bytes.Equal(headers[i].Key, headers[j].Key) {
					return nil, false
				}
			}
		}
	}
	pm := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(row.Payload), Headers: headers}
	if len(key) > 0 {
		pm.Key = sarama.StringEncoder(key)
	}
	return pm, true
}

func (f *Forwarder) send(topic string, b *batch) (err error) {
	if tr := f.tracing.Tracer(); tr != nil {
		span := startBatchSpan(tr, topic, b.msgs)
		defer func() {
			if err != nil {
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			}
			span.End()
		}()
	}
	if f.cfg.Publisher != nil {
		return f.cfg.Publisher.Publish(topic, b.msgs...)
	}
	if f.cfg.Producer.IsTransactional() {
		return f.sendTxn(b.records)
	}
	return f.cfg.Producer.SendMessages(b.records)
}

// sendTxn sends records as one Kafka transaction: all of them become
// visible to read_committed consumers, or none (the transaction is aborted
// when any record fails, and the caller sends the page again). The topics'
// loops share the producer, and a producer runs one transaction at a time.
func (f *Forwarder) sendTxn(records []*sarama.ProducerMessage) error {
	f.txnMu.Lock()
	defer f.txnMu.Unlock()
	p := f.cfg.Producer
	if err := readyTxn(p); err != nil {
		return err
	}
	if err := p.BeginTxn(); err != nil {
		return fmt.Errorf("begin Kafka transaction: %w", err)
	}
	err := p.SendMessages(records)
	if err == nil {
		if err = p.CommitTxn(); err == nil {
			return nil
		}
		err = fmt.Errorf("commit Kafka transaction: %w", err)
	}
	// A fatal error (fenced by another producer of the same id, say) leaves
	// nothing to abort: every later send fails until the producer is
	// replaced, and the error says why.
	if st := p.TxnStatus(); st&(sarama.ProducerTxnFlagInTransaction|sarama.ProducerTxnFlagAbortableError) != 0 && st&sarama.ProducerTxnFlagFatalError == 0 {
		if abortErr := p.AbortTxn(); abortErr != nil {
			return errors.Join(err, fmt.Errorf("abort Kafka transaction: %w", abortErr))
		}
	}
	return err
}

// startBatchSpan begins the span of one batch sent to the broker. A batch
// has many parents, so the messages' own trace contexts (stored with each
// row, sent on as their traceparent header) are links, not a parent.
func startBatchSpan(tr trace.Tracer, topic string, msgs []*message.Message) trace.Span {
	links := make([]trace.Link, 0, len(msgs))
	var bytes int
	var oldest time.Time
	for _, m := range msgs {
		bytes += len(m.Payload)
		if sc := otelx.Extract(m); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
		if t, err := time.Parse(time.RFC3339Nano, m.Metadata.Get(publisher.MetadataOccurredAt)); err == nil && (oldest.IsZero() || t.Before(oldest)) {
			oldest = t
		}
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
		semconv.MessagingDestinationName(topic),
		semconv.MessagingBatchMessageCount(len(msgs)),
		otelx.AttrBatchBytes.Int(bytes),
	}
	if !oldest.IsZero() {
		attrs = append(attrs, otelx.AttrOutboxLag.Float64(time.Since(oldest).Seconds()))
	}
	_, span := tr.Start(context.Background(), "send "+topic, trace.WithSpanKind(trace.SpanKindProducer), trace.WithLinks(links...), trace.WithAttributes(attrs...))
	return span
}

// readyTxn brings p back to a state where a transaction can begin after
// an earlier one did not end: a commit whose EndTxn failed (a network
// error, the coordinator moving, past its retries) is committed again
// (its records were all written; copies at most, in order), an abort or
// an epoch bump that did not finish is aborted again, a transaction left
// open by a failed send is aborted. Without this a shared producer would
// refuse every later BeginTxn ("invalid transition"), and every topic
// would stop until the process restarts. A fatal state (fenced by another
// producer of the same transactional id, say) cannot be left: the error
// says the producer must be replaced.
func readyTxn(p sarama.SyncProducer) error {
	st := p.TxnStatus()
	switch {
	case st&sarama.ProducerTxnFlagReady != 0:
		return nil
	case st&sarama.ProducerTxnFlagFatalError != 0:
		return fmt.Errorf("Kafka producer in a fatal transaction state (%s): it must be replaced (fenced by another producer of its transactional id?)", st)
	case st&sarama.ProducerTxnFlagCommittingTransaction != 0:
		if err := p.CommitTxn(); err != nil {
			return fmt.Errorf("finish an earlier Kafka transaction's commit (%s): %w", st, err)
		}
	case st&(sarama.ProducerTxnFlagInTransaction|sarama.ProducerTxnFlagAbortableError|sarama.ProducerTxnFlagAbortingTransaction|sarama.ProducerTxnFlagInitializing) != 0:
		if err := p.AbortTxn(); err != nil {
			return fmt.Errorf("abort an earlier Kafka transaction (%s): %w", st, err)
		}
	}
	return nil
}
