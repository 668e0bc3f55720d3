package soak

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/migrate"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// outboxProducer is the producer service as the library intends it: the
// business row and the outbox row commit in one transaction; a forwarder
// relays the outbox to Kafka.
type outboxProducer struct {
	h     *harness
	pool  *pgxpool.Pool // producer, application_name ...-producer
	fpool *pgxpool.Pool // forwarder, application_name ...-forwarder
	ob    *outbox.Outbox
	sp    sarama.SyncProducer

	oversize atomic.Int32 // oversize rows written

	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
}

func newOutboxProducer(ctx context.Context, h *harness) (*outboxProducer, error) {
	ob, err := outbox.New(outbox.Config{Schema: h.schema, Topics: []string{h.topic}}, h.logger)
	if err != nil {
		return nil, err
	}
	p := &outboxProducer{h: h, ob: ob}
	if p.pool, err = h.pool(ctx, "producer", int32(2*h.cfg.Producers+2)); err != nil {
		return nil, err
	}
	if p.fpool, err = h.pool(ctx, "forwarder", 4); err != nil {
		p.pool.Close()
		return nil, err
	}
	if err := migrate.Up(ctx, p.pool, outbox.MigrationLine(ob.Config(), h.topic)); err != nil {
		p.close()
		return nil, fmt.Errorf("outbox migrate: %w", err)
	}
	// Transactional: a page with a record that fails mid-election is
	// aborted whole, so a key's later record never overtakes an earlier
	// one on the topic (the consumers read committed).
	if p.sp, err = idemkafka.NewSyncProducer(idemkafka.ClientConfig{Brokers: h.brokers, TransactionalID: "soak-forwarder-" + h.runID}); err != nil {
		p.close()
		return nil, err
	}
	if err := p.startForwarder(); err != nil {
		p.close()
		return nil, err
	}
	return p, nil
}

func (p *outboxProducer) kind() string { return "outbox+forwarder" }

func (p *outboxProducer) dbComponents() []string { return []string{"forwarder", "producer"} }

func (p *outboxProducer) newForwarder() (*outbox.Forwarder, error) {
	return outbox.NewForwarder(outbox.ForwarderConfig{
		DB: p.fpool, Outbox: p.ob, Producer: p.sp,
		RetryInterval: 100 * time.Millisecond,
		// A kill, not a graceful stop: the in-flight batch is aborted and
		// sent again by the next forwarder.
		ShutdownTimeout: time.Nanosecond,
	}, p.h.logger)
}

// startForwarder runs a forwarder until the next restart. Run retries its
// own start-up while the database refuses connections; a forwarder that
// stops anyway is started again, as a supervisor would: counted in the
// report, not a violation.
func (p *outboxProducer) startForwarder() error {
	fwd, err := p.newForwarder()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			err := fwd.Run(ctx)
			if ctx.Err() != nil {
				return
			}
			p.h.forwarderExits.Add(1)
			p.h.logf("forwarder stopped (%v); starting it again", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
			if fwd, err = p.newForwarder(); err != nil {
				p.h.violation("forwarder: %v", err)
				return
			}
		}
	}()
	p.cancel, p.done = cancel, done
	return nil
}

func (p *outboxProducer) stopForwarder() {
	if p.cancel != nil {
		p.cancel()
		<-p.done
		p.cancel = nil
	}
}

func (p *outboxProducer) restart(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stopForwarder()
	// NewForwarder's table check fails while the database refuses
	// connections or a backend is terminated: start it again, as a
	// supervisor would.
	return retry(ctx, "restart forwarder", p.startForwarder)
}

func (p *outboxProducer) produce(ctx context.Context, ev event, msg *message.Message) error {
	id := msg.Metadata.Get(publisher.MetadataEventID)
	var wg sync.WaitGroup
	var dupErr error
	if ev.double {
		// The same event written to the outbox a second time, by a
		// concurrent transaction (a retried request, a second producer).
		p.h.doublePublished.Add(1)
		m := msg.Copy()
		wg.Go(func() {
			dupErr = retry(ctx, "outbox duplicate", func() error {
				return pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error { return p.ob.PublishInTx(ctx, tx, p.h.topic, m) })
			})
		})
	}
	err := retry(ctx, "produce", func() error {
		return pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
			tag, err := tx.Exec(ctx, `INSERT INTO soak_event (event_id, aggregate, seq, amount, fail, sleep_ms) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (event_id) DO NOTHING`,
				id, ev.aggregate, ev.seq, ev.amount, ev.fail, ev.sleep.Milliseconds())
			if err != nil {
				return err
			}
			if tag.RowsAffected() == 0 {
				return nil // an earlier attempt committed (its outcome was unknown)
			}
			return p.ob.PublishInTx(ctx, tx, p.h.topic, msg)
		})
	})
	wg.Wait()
	return errors.Join(err, dupErr)
}

// pending counts outbox rows after the forwarder's committed position.
func (p *outboxProducer) pending(ctx context.Context) (int, error) {
	b, err := p.ob.Backlog(ctx, p.h.admin, &outbox.BacklogOpts{Topics: []string{p.h.topic}})
	if err != nil {
		return 0, err
	}
	return int(b[0].Pending), nil
}

// oversizeKey is the partition key of the n-th oversize row: no event of
// the plan has it, so its quarantine holds back no planned event.
func oversizeKey(n int) string { return fmt.Sprintf("soak-oversize-%d", n) }

// writeOversize writes, as a writer that bypasses the outbox's own check
// would (another service, an older version, a manual INSERT), a row one
// byte over the producer's limit. The forwarder must move it to the dead
// table and go on.
func (p *outboxProducer) writeOversize(ctx context.Context) error {
	n := int(p.oversize.Add(1) - 1)
	payload := fmt.Sprintf(`{"pad":"%s"}`, strings.Repeat("x", sarama.NewConfig().Producer.MaxMessageBytes))
	// []byte: the payload column's bytea (or JSON), and raw JSON for the
	// metadata column. Retried as a writer would while the database drops
	// its connections (the disruption and pg-terminate faults); a commit
	// whose answer was lost can leave a second row of the key, which then
	// waits behind the first (verify allows that).
	for {
		_, err := p.pool.Exec(ctx, `INSERT INTO `+p.ob.MessagesTable(p.h.topic)+` (uuid, payload, metadata, transaction_id)
			VALUES ($1, $2, $3, pg_current_xact_id())`, uuid.NewString(), []byte(payload),
			[]byte(fmt.Sprintf(`{"partition_key":%q}`, oversizeKey(n))))
		if err == nil || ctx.Err() != nil {
			return err
		}
		p.h.logf("oversize row: %v, retrying", err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// deadRows returns the keys of the rows in the topic's dead table.
func (p *outboxProducer) deadKeys(ctx context.Context) ([]string, error) {
	rows, err := outboxsql.TopicTables(p.ob.Config().Schema, p.ob.Config().TablePrefix, p.h.topic).DeadRows(ctx, p.h.admin, nil, 0)
	if err != nil {
		return nil, err
	}
	keys := make([]string, len(rows))
	for i, r := range rows {
		keys[i] = r.Key
	}
	return keys, nil
}

func (p *outboxProducer) close() {
	p.mu.Lock()
	p.stopForwarder()
	p.mu.Unlock()
	if p.sp != nil {
		_ = p.sp.Close()
	}
	if p.fpool != nil {
		p.fpool.Close()
	}
	p.pool.Close()
}
