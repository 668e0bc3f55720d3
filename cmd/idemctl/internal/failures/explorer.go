package failures

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/components/heartbeat"
	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/auditsql"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// Config configures an [Explorer].
type Config struct {
	// DB holds the audit trail and the heartbeat table. Required.
	DB *pgxpool.Pool
	// Schema holds them. Defaults to "public".
	Schema string
	// Kafka reads the poison topics. Required.
	Kafka idemkafka.ClientConfig
	// Publisher sends replayed messages to their original topics, keyed by
	// partition_key (idemkafka.WatermillPublisherConfig). Required for the
	// actions.
	Publisher message.Publisher
	// Contracts check edited payloads. Defaults to none: every edit is
	// refused.
	Contracts Contracts
	// BatchLimit bounds the records one filtered action reads. Defaults to
	// 10,000.
	BatchLimit int
	// NowFunc is the replay time in a replayed message's history. Defaults
	// to time.Now.
	NowFunc func() time.Time
}

// Explorer reads poison topics and acts on their records.
type Explorer struct{ cfg Config }

// New returns an explorer over cfg.
func New(cfg Config) (*Explorer, error) {
	if cfg.Schema == "" {
		cfg.Schema = "public"
	}
	if cfg.BatchLimit == 0 {
		cfg.BatchLimit = 10_000
	}
	if cfg.NowFunc == nil {
		cfg.NowFunc = time.Now
	}
	switch {
	case cfg.DB == nil:
		return nil, errors.New("failures: DB: required")
	case len(cfg.Kafka.Brokers) == 0:
		return nil, errors.New("failures: Kafka.Brokers: required")
	}
	return &Explorer{cfg: cfg}, nil
}

// MigrationLines are the tables the explorer reads and writes: the audit
// trail and the heartbeat table, in schema.
func MigrationLines(schema string) []migrate.Line {
	if schema == "" {
		schema = "public"
	}
	return []migrate.Line{
		{Component: auditsql.Component, Schema: schema, Templates: []fs.FS{auditsql.Migrations}, Data: struct{ Schema string }{schema}},
		heartbeat.MigrationLine(schema),
	}
}

// Row is one record of a page with what was last done to it.
type Row struct {
	poison.Record
	// Done is the last successful action on the record, nil if none.
	Done *auditsql.Disposition
}

// Page is one page of the explorer.
type Page struct {
	*poison.Page
	Rows []Row
}

// Page reads one page of topic (see poison.ReadPage) with each record's
// disposition from the audit trail: one Kafka read and one query.
func (e *Explorer) Page(ctx context.Context, topic string, filter poison.Filter, from map[int32]int64, size int) (*Page, error) {
	p, err := poison.ReadPage(ctx, poison.PageConfig{Kafka: e.cfg.Kafka, Topic: topic, Filter: filter, From: from, Size: size})
	if err != nil {
		return nil, err
	}
	disp, err := e.dispositions(ctx, topic, p.Records)
	if err != nil {
		return nil, err
	}
	out := &Page{Page: p, Rows: make([]Row, len(p.Records))}
	for i, r := range p.Records {
		out.Rows[i] = Row{Record: r}
		if d, ok := disp[auditsql.Location{Partition: r.Partition, Offset: r.Offset}]; ok {
			out.Rows[i].Done = &d
		}
	}
	return out, nil
}

func (e *Explorer) dispositions(ctx context.Context, topic string, recs []poison.Record) (map[auditsql.Location]auditsql.Disposition, error) {
	locs := make([]auditsql.Location, len(recs))
	for i, r := range recs {
		locs[i] = auditsql.Location{Partition: r.Partition, Offset: r.Offset}
	}
	return auditsql.Dispositions(ctx, e.cfg.DB, e.cfg.Schema, topic, locs)
}

// Detail reads one record and its disposition.
func (e *Explorer) Detail(ctx context.Context, topic string, partition int32, offset int64) (*Row, error) {
	r, err := e.get(ctx, topic, partition, offset)
	if err != nil {
		return nil, err
	}
	disp, err := e.dispositions(ctx, topic, []poison.Record{*r})
	if err != nil {
		return nil, err
	}
	row := &Row{Record: *r}
	if d, ok := disp[auditsql.Location{Partition: partition, Offset: offset}]; ok {
		row.Done = &d
	}
	return row, nil
}

// Reason is one failure reason among the records read.
type Reason struct {
	Reason string `json:"reason"`
	Count  int    `json:"count"`
	// Topics are the original topics of the records with this reason.
	Topics []string `json:"topics"`
	// First and Last are the times the first and last were poisoned.
	First, Last time.Time
}

// Reasons groups the newest window records of topic (at most, over its
// partitions) that filter selects by reason, most frequent first; scanned
// is how many were read.
func (e *Explorer) Reasons(ctx context.Context, topic string, filter poison.Filter, window int) (reasons []Reason, scanned int, err error) {
	probe, err := poison.ReadPage(ctx, poison.PageConfig{Kafka: e.cfg.Kafka, Topic: topic, Size: 1, ScanLimit: 1})
	if err != nil {
		return nil, 0, err
	}
	from := map[int32]int64{}
	per := int64(window / max(1, len(probe.Oldest)))
	for p, oldest := range probe.Oldest {
		from[p] = max(oldest, probe.Newest[p]-per)
	}
	byReason := map[string]*Reason{}
	for {
		p, err := poison.ReadPage(ctx, poison.PageConfig{Kafka: e.cfg.Kafka, Topic: topic, Filter: filter, From: from, Size: 1000, ScanLimit: 1000})
		if err != nil {
			return nil, scanned, err
		}
		scanned += p.Scanned
		for _, r := range p.Records {
			g := byReason[r.Reason]
			if g == nil {
				g = &Reason{Reason: r.Reason, First: r.PoisonedAt}
				byReason[r.Reason] = g
			}
			g.Count++
			g.First, g.Last = minTime(g.First, r.PoisonedAt), maxTime(g.Last, r.PoisonedAt)
			if !slices.Contains(g.Topics, r.OriginalTopic) {
				g.Topics = append(g.Topics, r.OriginalTopic)
			}
		}
		if p.End || p.Scanned == 0 {
			break
		}
		from = p.Next
	}
	for _, g := range byReason {
		slices.Sort(g.Topics)
		reasons = append(reasons, *g)
	}
	slices.SortFunc(reasons, func(a, b Reason) int {
		if a.Count != b.Count {
			return b.Count - a.Count
		}
		return strings.Compare(a.Reason, b.Reason)
	})
	return reasons, scanned, nil
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

var errNoPublisher = fmt.Errorf("failures: no publisher: the console reads the poison topic only")

// ErrNoRecord: no record at that place of the poison topic (out of its
// partition's range, or removed by the topic's retention).
var ErrNoRecord = errors.New("no such poison record")

// get reads the record at partition and offset of topic.
func (e *Explorer) get(ctx context.Context, topic string, partition int32, offset int64) (*poison.Record, error) {
	if partition >= 0 && offset >= 0 {
		p, err := poison.ReadPage(ctx, poison.PageConfig{Kafka: e.cfg.Kafka, Topic: topic, From: map[int32]int64{partition: offset},
			Partitions: []int32{partition}, Size: 1, ScanLimit: 1})
		if err != nil {
			return nil, err
		}
		if len(p.Records) == 1 && p.Records[0].Offset == offset {
			return &p.Records[0], nil
		}
	}
	return nil, fmt.Errorf("failures: %w: %s/%d@%d", ErrNoRecord, topic, partition, offset)
}
