package poison

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"golang.org/x/sync/errgroup"

	"github.com/idemkit/watermill-idempotency/idemkafka"
)

const (
	defaultPageSize  = 50
	defaultScanLimit = 1000
	pageFetchWait    = 20 * time.Millisecond
)

// PageConfig configures [ReadPage].
type PageConfig struct {
	// Kafka names the brokers (required) and the base Sarama config.
	Kafka idemkafka.ClientConfig
	// Topic is the poison topic. Required.
	Topic string
	// Filter selects the records. Defaults to the zero Filter: all.
	Filter Filter
	// From is where the page starts: the next offset to read of each
	// partition ([Page.Next] of the previous page). A partition it does not
	// name starts at its oldest offset. Defaults to nil: the first page.
	From map[int32]int64
	// Partitions, when set, are the only partitions read (a record's
	// detail: one partition, From its offset, Size 1). Defaults to nil:
	// every partition.
	Partitions []int32
	// Size is the most records on the page. Defaults to 50.
	Size int
	// ScanLimit bounds the records read from each partition for one page,
	// matching or not: a narrow filter over a large topic returns a short
	// page and a Next to go on from, rather than reading the topic whole.
	// Defaults to 1,000.
	ScanLimit int
	// IdleTimeout is how long a partition may deliver nothing before the
	// end of its range ([ErrIncompleteRead]). Defaults to 30 s.
	IdleTimeout time.Duration
}

func (c *PageConfig) setDefaults() {
	if c.Size == 0 {
		c.Size = defaultPageSize
	}
	if c.ScanLimit == 0 {
		c.ScanLimit = defaultScanLimit
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = defaultIdleTimeout
	}
}

func (c PageConfig) validate() error {
	switch {
	case len(c.Kafka.Brokers) == 0:
		return errors.New("Kafka.Brokers: required")
	case c.Topic == "":
		return errors.New("Topic: required (the poison topic)")
	case c.Size < 0:
		return fmt.Errorf("Size: %d must not be negative", c.Size)
	case c.ScanLimit < 0:
		return fmt.Errorf("ScanLimit: %d must not be negative", c.ScanLimit)
	case c.IdleTimeout < 0:
		return errors.New("IdleTimeout: must not be negative")
	case slices.ContainsFunc(c.Partitions, func(p int32) bool { return p < 0 }):
		return fmt.Errorf("Partitions: %v holds a negative partition", c.Partitions)
	}
	return c.Filter.validate()
}

// Record is one record of the poison topic with its content: what an
// operator's detail view shows (through its redaction) and what
// [Record.Republish] sends back.
type Record struct {
	Message
	// Key is the Kafka record key.
	Key []byte `json:"-"`
	// Metadata are the message's headers, Payload its payload.
	Metadata message.Metadata `json:"-"`
	Payload  []byte           `json:"-"`
}

// partitionRange is what a partition holds: offsets oldest to newest-1.
type partitionRange struct {
	partition      int32
	oldest, newest int64
}

// Page is one page of a poison topic.
type Page struct {
	// Records are the matching records, in the order they were poisoned
	// (merged across partitions, each partition in offset order).
	Records []Record
	// Next is the From of the next page.
	Next map[int32]int64
	// End: every partition was read to its newest offset; the next page is
	// empty until more records arrive.
	End bool
	// Scanned is the number of records read.
	Scanned int
	// Oldest and Newest are each partition's oldest offset and the offset
	// after its newest record when the page was read; Depth is the records
	// they hold.
	Oldest, Newest map[int32]int64
	Depth          int64
}

// ReadPage reads one page of the poison topic without reading it whole:
// from each partition at most ScanLimit records from cfg.From, stopping at
// Size matching ones, then merges them by the time they were poisoned and
// keeps the first Size. Each partition's Next is the first record read but
// not kept, else where its read stopped, so paging with Next never skips
// nor repeats a record. Like [List], it reads outside any consumer group.
func ReadPage(ctx context.Context, cfg PageConfig) (*Page, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("poison: invalid config: %w", err)
	}
	sc := idemkafka.SaramaConsumerConfig(cfg.Kafka.Sarama)
	sc.Consumer.Return.Errors = true
	// A partition's last fetch waits this long for records past its
	// range before the page can close it.
	sc.Consumer.MaxWaitTime = pageFetchWait
	client, err := sarama.NewClient(cfg.Kafka.Brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("poison: connect: %w", err)
	}
	defer client.Close()
	ranges, err := partitionRanges(client, cfg.Topic)
	if err != nil {
		return nil, err
	}
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("poison: %w", err)
	}
	defer consumer.Close()
	page := &Page{Next: map[int32]int64{}, Oldest: map[int32]int64{}, Newest: map[int32]int64{}}
	queues := make([][]Record, len(ranges))
	nexts := make([]int64, len(ranges))
	scanned := make([]int, len(ranges))
	g, gctx := errgroup.WithContext(ctx)
	for i, r := range ranges { // partitions at once: a page costs one fetch, not one per partition
		page.Depth += r.newest - r.oldest
		page.Oldest[r.partition], page.Newest[r.partition] = r.oldest, r.newest
		if cfg.Partitions != nil && !slices.Contains(cfg.Partitions, r.partition) {
			nexts[i] = -1
			continue
		}
		from := r.oldest
		if f, ok := cfg.From[r.partition]; ok {
			from = max(f, r.oldest)
		}
		stop := min(r.newest, from+int64(cfg.ScanLimit))
		g.Go(func() (err error) {
			queues[i], nexts[i], err = readRange(gctx, consumer, cfg, r.partition, from, stop, &scanned[i])
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	for i, r := range ranges {
		page.Scanned += scanned[i]
		if nexts[i] >= 0 {
			page.Next[r.partition] = nexts[i]
		}
	}
	page.Records = merge(queues, page.Next, cfg.Size)
	page.End = true
	for _, r := range ranges {
		if next, ok := page.Next[r.partition]; ok && next < r.newest {
			page.End = false
		}
	}
	return page, nil
}

func partitionRanges(client sarama.Client, topic string) ([]partitionRange, error) {
	ps, err := client.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("poison: partitions of %s: %w", topic, err)
	}
	slices.Sort(ps)
	out := make([]partitionRange, len(ps))
	for i, p := range ps {
		lo, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, fmt.Errorf("poison: oldest offset of %s/%d: %w", topic, p, err)
		}
		hi, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return nil, fmt.Errorf("poison: newest offset of %s/%d: %w", topic, p, err)
		}
		out[i] = partitionRange{partition: p, oldest: lo, newest: hi}
	}
	return out, nil
}

// readRange reads partition p from offset from to stop (excluded), or
// until cfg.Size records matched; it returns them and the offset after the
// last record read.
func readRange(ctx context.Context, consumer sarama.Consumer, cfg PageConfig, p int32, from, stop int64, scanned *int) ([]Record, int64, error) {
	if from >= stop || cfg.Size == 0 {
		return nil, from, nil
	}
	pc, err := consumer.ConsumePartition(cfg.Topic, p, from)
	if err != nil {
		return nil, from, fmt.Errorf("poison: read %s/%d: %w", cfg.Topic, p, err)
	}
	defer pc.Close()
	idle := time.NewTimer(cfg.IdleTimeout)
	defer idle.Stop()
	var out []Record
	next := from
	for next < stop && len(out) < cfg.Size {
		select {
		case rec := <-pc.Messages():
			*scanned++
			next = rec.Offset + 1
			r, err := toRecord(rec)
			if err != nil {
				return nil, from, err
			}
			if cfg.Filter.match(r.Message) {
				out = append(out, r)
			}
			idle.Reset(cfg.IdleTimeout)
		case err := <-pc.Errors():
			return nil, from, fmt.Errorf("poison: read %s/%d: %w", cfg.Topic, p, err)
		case <-idle.C:
			return nil, from, fmt.Errorf("poison: %w: %s/%d delivered nothing for %s before offset %d", ErrIncompleteRead, cfg.Topic, p, cfg.IdleTimeout, stop)
		case <-ctx.Done():
			return nil, from, fmt.Errorf("poison: read %s/%d: %w", cfg.Topic, p, ctx.Err())
		}
	}
	return out, next, nil
}

func toRecord(rec *sarama.ConsumerMessage) (Record, error) {
	msg, err := kafka.DefaultMarshaler{}.Unmarshal(rec)
	if err != nil {
		return Record{}, fmt.Errorf("poison: unmarshal %s/%d@%d: %w", rec.Topic, rec.Partition, rec.Offset, err)
	}
	return Record{Message: describe(msg, rec.Partition, rec.Offset, rec.Timestamp), Key: rec.Key,
		Metadata: msg.Metadata, Payload: msg.Payload}, nil
}

// merge takes the first size records of the queues (one per partition, in
// offset order) by poisoned time, a k-way merge so that each partition's
// records taken are a prefix of its queue; next of a partition with records
// left over becomes the first of them.
func merge(queues [][]Record, next map[int32]int64, size int) []Record {
	var out []Record
	for len(out) < size {
		best := -1
		for i, q := range queues {
			if len(q) == 0 {
				continue
			}
			if best < 0 || before(q[0].Message, queues[best][0].Message) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		out = append(out, queues[best][0])
		queues[best] = queues[best][1:]
	}
	for _, q := range queues {
		if len(q) > 0 {
			next[q[0].Partition] = q[0].Offset
		}
	}
	return out
}

func before(a, b Message) bool {
	if c := a.PoisonedAt.Compare(b.PoisonedAt); c != 0 {
		return c < 0
	}
	return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Offset, b.Offset)) < 0
}

// Republish publishes r back to its original topic as [Replay] does (the
// same UUID, payload and headers, without the poison keys, the poisoning
// appended to [MetadataReasonHistory]), with payload in place of its own
// when payload is not nil: an edited event keeps its headers, its event_id
// among them.
func (r Record) Republish(pub message.Publisher, payload []byte, now time.Time) error {
	if r.Skipped != "" {
		return fmt.Errorf("poison: %s/%d@%d cannot be replayed: %s", "record", r.Partition, r.Offset, r.Skipped)
	}
	msg := message.NewMessage(r.UUID, r.Payload)
	msg.Metadata = r.Metadata
	if payload != nil {
		msg.Payload = payload
	}
	out, err := restore(msg, r.Message, r.Key, now)
	if err != nil {
		return fmt.Errorf("poison: %w", err)
	}
	if err := pub.Publish(r.OriginalTopic, out); err != nil {
		return fmt.Errorf("poison: %w: %d@%d (event %s) to %s: %w", ErrPublish, r.Partition, r.Offset, r.EventID, r.OriginalTopic, err)
	}
	return nil
}
