package poison

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/wait"
)

// Config configures [List] and [Replay].
type Config struct {
	// Kafka names the brokers (required) and the base Sarama config (TLS,
	// SASL...) the poison topic is read with.
	Kafka idemkafka.ClientConfig
	// Topic is the poison topic. Required.
	Topic string
	// Publisher publishes the replayed messages (to each one's
	// topic_poisoned). Required by Replay unless DryRun. Use a Kafka
	// publisher keyed by partition_key (idemkafka.WatermillPublisherConfig),
	// so a replayed event lands in its key's partition.
	Publisher message.Publisher
	// Filter selects the messages. Defaults to the zero Filter: all.
	Filter Filter
	// DryRun lists what would be replayed and publishes nothing. Defaults
	// to false.
	DryRun bool
	// Limit stops after this many matching messages. Defaults to 0: no limit.
	Limit int
	// Rate is the most messages published per second. Defaults to
	// 50; negative means no limit.
	Rate float64
	// IdleTimeout is how long a partition may deliver nothing before it
	// reached the end it had when the read started ([ErrIncompleteRead]).
	// Defaults to 30 s.
	IdleTimeout time.Duration
	// OnMessageFunc, when set, is called for each matching message, in
	// order, once it has been replayed (or, in a dry run, listed): a CLI
	// prints as it goes. The returned [Result] holds the same messages.
	// Defaults to nil.
	OnMessageFunc func(Message)
	// NowFunc returns the current time (the replay time in the history).
	// Defaults to time.Now.
	NowFunc func() time.Time
}

func (c *Config) setDefaults() {
	if c.Rate == 0 {
		c.Rate = defaultRate
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = defaultIdleTimeout
	}
	if c.NowFunc == nil {
		c.NowFunc = time.Now
	}
}

func (c Config) validate() error {
	switch {
	case len(c.Kafka.Brokers) == 0:
		return errors.New("Kafka.Brokers: required")
	case c.Topic == "":
		return errors.New("Topic: required (the poison topic)")
	case c.Publisher == nil && !c.DryRun:
		return errors.New("Publisher: required unless DryRun")
	case c.Limit < 0:
		return fmt.Errorf("Limit: %d must not be negative", c.Limit)
	case math.IsNaN(c.Rate):
		return errors.New("Rate: NaN")
	case c.IdleTimeout < 0:
		return errors.New("IdleTimeout: must not be negative")
	}
	return c.Filter.validate()
}

// Result tells what [List] or [Replay] did.
type Result struct {
	// Scanned is the number of poison records read.
	Scanned int `json:"scanned"`
	// Matched is the number that passed the filter (at most Limit).
	Matched int `json:"matched"`
	// Replayed is the number published back (0 in a dry run).
	Replayed int `json:"replayed"`
	// Skipped is the number of matching messages that cannot be replayed
	// (see [Message.Skipped]).
	Skipped int `json:"skipped"`
	// Messages are the matching messages, by partition and offset.
	Messages []Message `json:"messages"`
}

// List reads the poison topic from its start to its current end and
// returns the messages that match cfg.Filter, without publishing anything
// (Replay with DryRun).
func List(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (*Result, error) {
	cfg.DryRun = true
	return Replay(ctx, cfg, logger)
}

// Replay reads the poison topic from its start to the end it has when
// Replay starts, and publishes each message that matches cfg.Filter back to
// its original topic (topic_poisoned), at most cfg.Rate per second: the same
// UUID, payload and metadata (event_id, partition_key, occurred_at,
// traceparent ...), without reason_poisoned, topic_poisoned,
// handler_poisoned, subscriber_poisoned and the retry-topic headers, the
// poisoning appended to [MetadataReasonHistory]. With cfg.DryRun it only
// lists them.
//
// The poison topic is not changed (Kafka cannot delete a record): a second
// Replay with the same filter publishes the same messages again. That is
// safe: an event applied by the first replay is a duplicate for the
// consumer's claim (as is one that was applied before it was poisoned);
// one that fails again is poisoned again, as a new record with its history.
// Narrow a repeated replay with Filter.PoisonedFrom.
//
// The topic is read with Sarama's partition consumer, outside any consumer
// group: nothing is committed, so List and Replay can run any number of
// times and never move a consumer's offsets; the end of each partition is
// its high-water mark when Replay starts. Partitions are read one after
// the other, each in offset order, so the events of one key are replayed in
// the order they were poisoned.
//
// On error the Result tells how far it got.
func Replay(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (*Result, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("poison: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	r := &replayer{cfg: cfg, logger: logger, res: &Result{}, every: interval(cfg.Rate)}
	err := r.run(ctx)
	return r.res, err
}

type replayer struct {
	cfg    Config
	logger watermill.LoggerAdapter
	res    *Result
	every  time.Duration
	next   time.Time // earliest time of the next publish
}

// errLimit ends the read once Limit messages matched.
var errLimit = errors.New("limit reached")

func (r *replayer) run(ctx context.Context) error {
	sc := idemkafka.SaramaConsumerConfig(r.cfg.Kafka.Sarama)
	sc.Consumer.Return.Errors = true
	client, err := sarama.NewClient(r.cfg.Kafka.Brokers, sc)
	if err != nil {
		return fmt.Errorf("poison: connect: %w", err)
	}
	defer client.Close()
	partitions, err := client.Partitions(r.cfg.Topic)
	if err != nil {
		return fmt.Errorf("poison: partitions of %s: %w", r.cfg.Topic, err)
	}
	slices.Sort(partitions)
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return fmt.Errorf("poison: %w", err)
	}
	defer consumer.Close()
	for _, p := range partitions {
		err := r.partition(ctx, client, consumer, p)
		if errors.Is(err, errLimit) {
			break
		}
		if err != nil {
			return err
		}
	}
	r.logger.Info("Poison topic read", watermill.LogFields{
		"topic": r.cfg.Topic, "scanned": r.res.Scanned, "matched": r.res.Matched,
		"replayed": r.res.Replayed, "skipped": r.res.Skipped, "dry_run": r.cfg.DryRun,
	})
	return nil
}

// partition reads partition p from its oldest offset to its high-water mark.
func (r *replayer) partition(ctx context.Context, client sarama.Client, consumer sarama.Consumer, p int32) error {
	oldest, err := client.GetOffset(r.cfg.Topic, p, sarama.OffsetOldest)
	if err != nil {
		return fmt.Errorf("poison: oldest offset of %s/%d: %w", r.cfg.Topic, p, err)
	}
	end, err := client.GetOffset(r.cfg.Topic, p, sarama.OffsetNewest)
	if err != nil {
		return fmt.Errorf("poison: newest offset of %s/%d: %w", r.cfg.Topic, p, err)
	}
	if oldest >= end {
		return nil
	}
	pc, err := consumer.ConsumePartition(r.cfg.Topic, p, oldest)
	if err != nil {
		return fmt.Errorf("poison: read %s/%d: %w", r.cfg.Topic, p, err)
	}
	defer pc.Close()
	idle := time.NewTimer(r.cfg.IdleTimeout)
	defer idle.Stop()
	for {
		select {
		case rec := <-pc.Messages():
			if err := r.record(ctx, rec); err != nil {
				return err
			}
			if rec.Offset+1 >= end {
				return nil
			}
			idle.Reset(r.cfg.IdleTimeout)
		case err := <-pc.Errors():
			return fmt.Errorf("poison: read %s/%d: %w", r.cfg.Topic, p, err)
		case <-idle.C:
			return fmt.Errorf("poison: %w: %s/%d delivered nothing for %s before offset %d", ErrIncompleteRead, r.cfg.Topic, p, r.cfg.IdleTimeout, end)
		case <-ctx.Done():
			return fmt.Errorf("poison: read %s/%d: %w", r.cfg.Topic, p, ctx.Err())
		}
	}
}

// record lists or replays one poison record.
func (r *replayer) record(ctx context.Context, rec *sarama.ConsumerMessage) error {
	r.res.Scanned++
	msg, err := kafka.DefaultMarshaler{}.Unmarshal(rec)
	if err != nil {
		return fmt.Errorf("poison: unmarshal %s/%d@%d: %w", rec.Topic, rec.Partition, rec.Offset, err)
	}
	m := describe(msg, rec.Partition, rec.Offset, rec.Timestamp)
	if !r.cfg.Filter.match(m) {
		return nil
	}
	r.res.Matched++
	if m.Skipped != "" {
		r.res.Skipped++
	} else if m.OriginalTopic == r.cfg.Topic {
		m.Skipped = "topic_poisoned is the poison topic itself"
		r.res.Skipped++
	} else if !r.cfg.DryRun {
		if err := r.publish(ctx, msg, m, rec.Key); err != nil {
			r.res.Messages = append(r.res.Messages, m)
			return err
		}
		m.Replayed = true
		r.res.Replayed++
	}
	r.res.Messages = append(r.res.Messages, m)
	if r.cfg.OnMessageFunc != nil {
		r.cfg.OnMessageFunc(m)
	}
	if r.cfg.Limit > 0 && r.res.Matched >= r.cfg.Limit {
		return errLimit
	}
	return nil
}

// publish waits for the rate limit, then publishes msg back.
func (r *replayer) publish(ctx context.Context, msg *message.Message, m Message, key []byte) error {
	if err := wait.Sleep(ctx, time.Until(r.next)); err != nil {
		return fmt.Errorf("poison: replay: %w", err)
	}
	out, err := restore(msg, m, key, r.cfg.NowFunc())
	if err != nil {
		return fmt.Errorf("poison: %w", err)
	}
	if err := r.cfg.Publisher.Publish(m.OriginalTopic, out); err != nil {
		return fmt.Errorf("poison: %w: %s/%d@%d (event %s) to %s: %w", ErrPublish, r.cfg.Topic, m.Partition, m.Offset, m.EventID, m.OriginalTopic, err)
	}
	r.next = time.Now().Add(r.every)
	r.logger.Debug("Poison message replayed", watermill.LogFields{
		"event_id": m.EventID, "message_uuid": m.UUID, "topic": m.OriginalTopic, "partition": m.Partition, "offset": m.Offset,
	})
	return nil
}
