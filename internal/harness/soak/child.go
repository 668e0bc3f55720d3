package soak

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// ConsumerEnv names the environment variable that makes [RunConsumerIfChild]
// run the process as one soak consumer. The soak starts each consumer
// instance by re-executing its own binary ([Config.Executable]) with this
// variable set to the instance's settings, so that it can kill instances
// with SIGKILL: a real process death, where the member never leaves its
// consumer group, its TCP connections drop and its open transaction is
// rolled back by PostgreSQL.
const ConsumerEnv = "IDEM_SOAK_CONSUMER"

// RunConsumerIfChild returns at once unless [ConsumerEnv] is set; then it
// runs a soak consumer until SIGTERM (or its standard input closes: the soak
// is gone) and exits the process. Call it first in main, or in TestMain of a
// test binary that runs the soak.
func RunConsumerIfChild() {
	v, ok := os.LookupEnv(ConsumerEnv)
	if !ok {
		return
	}
	var cfg childConfig
	if err := json.Unmarshal([]byte(v), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "soak consumer: %s: %v\n", ConsumerEnv, err)
		os.Exit(2)
	}
	if err := runConsumer(cfg); err != nil {
		fmt.Fprintf(os.Stderr, "soak consumer %s: %v\n", cfg.Instance, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// childConfig is what a consumer process gets from the soak, as JSON in
// [ConsumerEnv].
type childConfig struct {
	DatabaseURL string   `json:"database_url"`
	Database    string   `json:"database"`
	Schema      string   `json:"schema"`
	AppName     string   `json:"app_name"` // application_name, which the pg-terminate fault targets
	Brokers     []string `json:"brokers"`
	Topic       string   `json:"topic"`
	DLQ         string   `json:"dlq"`
	Group       string   `json:"group"`
	Instance    string   `json:"instance"`
	CopyToDLQ   bool     `json:"copy_to_dlq"`
	Unsafe      bool     `json:"unsafe_ledger_outside_tx"`
	MaxConns    int32    `json:"max_conns"`
	Verbose     bool     `json:"verbose"`
	GroupCommit bool     `json:"group_commit"`
}

// The consumer-to-soak protocol: one line on standard output per event.
const (
	lineReady     = "ready"
	lineDelivery  = "d"   // a message reached the outer middleware
	lineApplied   = "a"   // the handler ran and its transaction committed
	lineDuplicate = "u"   // acked without running the handler
	lineFailed    = "f"   // error returned: nacked, redelivered
	lineDLQ       = "q"   // a copy was published to the dead-letter topic
	lineKill      = "k "  // + fault kind: about to SIGKILL itself
	lineViolation = "v "  // + description
	cmdKillMid    = "mid" // soak-to-consumer commands, on standard input
	cmdKillCommit = "commit"
)

// tableConfig is the processed_event table of a run, for the soak and its
// consumer processes alike.
func tableConfig(schema string) deduplicator.TableConfig {
	return deduplicator.TableConfig{Schema: schema}
}

// pgPool opens a pool on the run's database and schema, its connections
// named application_name.
func pgPool(ctx context.Context, url, database, schema, applicationName string, maxConns int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pc.ConnConfig.Database = database
	pc.ConnConfig.RuntimeParams["search_path"] = schema
	pc.ConnConfig.RuntimeParams["application_name"] = applicationName
	pc.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, pc)
}

type child struct {
	cfg    childConfig
	pool   *pgxpool.Pool
	dlqPub *kafka.Publisher
	armed  atomic.Int32 // pendingKillMid / pendingKillCommit
	outMu  sync.Mutex
}

// emit writes one protocol line, unbuffered: a line written before a
// SIGKILL reaches the soak.
func (c *child) emit(line string) {
	c.outMu.Lock()
	defer c.outMu.Unlock()
	_, _ = os.Stdout.WriteString(line + "\n")
}

// die kills the process with SIGKILL, at the exact point of the fault.
func (c *child) die(kind string) {
	c.emit(lineKill + kind)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

func runConsumer(cfg childConfig) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	c := &child{cfg: cfg}
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			switch in.Text() {
			case cmdKillMid:
				c.armed.Store(pendingKillMid)
			case cmdKillCommit:
				c.armed.Store(pendingKillCommit)
			}
		}
		stop() // the soak closed our input, or is gone
	}()

	var logger watermill.LoggerAdapter = errorLogger{watermill.NewStdLoggerWithOut(os.Stderr, false, false)}
	if cfg.Verbose {
		logger = watermill.NewStdLoggerWithOut(os.Stderr, false, false)
		sarama.Logger = log.New(os.Stderr, "[sarama] ", log.LstdFlags|log.Lmicroseconds)
	}
	logger = logger.With(watermill.LogFields{"instance": cfg.Instance})

	var err error
	if c.pool, err = pgPool(ctx, cfg.DatabaseURL, cfg.Database, cfg.Schema, cfg.AppName, cfg.MaxConns); err != nil {
		return err
	}
	defer c.pool.Close()
	// The database may be refusing connections (a disruption): retry.
	var dedup *idem.Dedup
	if err := retry(ctx, "dedup middleware", func() error {
		dcfg := idem.Config{DB: c.pool, ConsumerGroup: cfg.Group, Table: tableConfig(cfg.Schema)}
		if cfg.GroupCommit {
			dcfg.GroupCommit = &idem.GroupCommitConfig{}
		}
		dedup, err = idem.NewDedup(dcfg, logger)
		return err
	}); err != nil {
		return err
	}
	// The library's default Sarama settings: only the brokers and the group.
	subCfg, err := publisher.NewKafkaSubscriberConfig(publisher.KafkaConfig{Brokers: cfg.Brokers}, cfg.Group)
	if err != nil {
		return err
	}
	sub, err := kafka.NewSubscriber(subCfg, logger)
	if err != nil {
		return err
	}
	if cfg.CopyToDLQ {
		pc, err := publisher.NewKafkaPublisherConfig(publisher.KafkaConfig{Brokers: cfg.Brokers})
		if err != nil {
			return err
		}
		if c.dlqPub, err = kafka.NewPublisher(pc, logger); err != nil {
			return err
		}
		defer c.dlqPub.Close()
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 20 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("soak-"+cfg.Instance, cfg.Topic, sub, c.outer(ctx, dedup.Middleware(c.handler)))
	go func() {
		select {
		case <-router.Running():
			c.emit(lineReady)
		case <-ctx.Done():
		}
	}()
	return router.Run(ctx) // until SIGTERM: Close leaves the group, in-flight messages are not acked
}

// outer sits outside the dedup middleware: it reports deliveries, applied
// messages and absorbed duplicates, copies the first group's applied DLQ
// events to the dead-letter topic, and dies after COMMIT when armed.
func (c *child) outer(ctx context.Context, next message.HandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		d := &delivery{}
		msg.SetContext(context.WithValue(msg.Context(), stateKey{}, d))
		c.emit(lineDelivery)
		_, err := next(msg)
		switch {
		case err != nil && idem.IsPermanent(err):
			c.emit(lineViolation + "permanent error (would go to the poison queue): " + oneLine(err.Error()))
			return nil
		case err != nil:
			c.emit(lineFailed)
			return err
		case !d.ran:
			c.emit(lineDuplicate)
			return nil
		}
		c.emit(lineApplied)
		if c.dlqPub != nil && msg.Metadata.Get(metaDLQ) == "1" {
			m := message.NewMessage(watermill.NewUUID(), msg.Payload)
			for k, v := range msg.Metadata {
				if k != metaDLQ {
					m.Metadata.Set(k, v)
				}
			}
			if err := retry(ctx, "publish to dlq", func() error { return c.dlqPub.Publish(c.cfg.DLQ, m) }); err == nil {
				c.emit(lineDLQ)
			}
		}
		if c.armed.CompareAndSwap(pendingKillCommit, pendingNone) {
			// COMMIT happened, the ack will not: the next owner gets the
			// message again and must absorb it as a duplicate.
			c.die(faultKillCommit)
		}
		return nil
	}
}

// handler applies the event: one ledger row in the middleware's transaction
// (or, for the broken handler of the checker's own test, through the pool).
func (c *child) handler(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	var p payload
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return nil, idem.Permanent(fmt.Errorf("%w: %v", idem.ErrMalformedPayload, err))
	}
	id, _ := idem.EventIDFromContext(ctx)
	var db interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	} = idem.MustTxFromContext(ctx)
	if c.cfg.Unsafe {
		db = c.pool
	}
	if _, err := db.Exec(ctx, `INSERT INTO soak_ledger (grp, event_id, aggregate, seq, amount) VALUES ($1, $2, $3, $4, $5)`,
		c.cfg.Group, id, p.Aggregate, p.Seq, p.Amount); err != nil {
		return nil, err
	}
	if c.armed.CompareAndSwap(pendingKillMid, pendingNone) {
		// Inside the transaction: business row written, not committed.
		c.die(faultKillMid)
	}
	if d, ok := ctx.Value(stateKey{}).(*delivery); ok {
		d.ran = true
	}
	return nil, nil
}

func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }

// errorLogger drops everything below error level: a consumer's stderr
// carries only errors unless the soak runs verbose.
type errorLogger struct{ watermill.LoggerAdapter }

func (l errorLogger) Info(string, watermill.LogFields)  {}
func (l errorLogger) Debug(string, watermill.LogFields) {}
func (l errorLogger) Trace(string, watermill.LogFields) {}
func (l errorLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return errorLogger{l.LoggerAdapter.With(f)}
}
