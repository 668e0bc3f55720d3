package progresssql

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/dbx"
	"github.com/idemkit/watermill-idempotency/internal/ident"
)

// Table returns the quoted, schema-qualified progress table of the claim
// table schema.table.
func Table(schema, table string) string { return ident.Quote(schema, table+"_progress") }

// timeline is the server's current WAL timeline: a promotion and a
// point-in-time restore each start a new one. It fails on a standby.
const timeline = "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint"

// Upsert advances the rows of group $1 for the partitions given as the
// parallel arrays $2 (topic), $3 (partition), $4 (next offset): a row only
// moves forward, so a redelivery of an older record never rewinds it.
func Upsert(progressTable string) string {
	return "INSERT INTO " + progressTable + " AS p (consumer_group, topic, kafka_partition, next_offset) " +
		"SELECT $1, t, k, o FROM unnest($2::text[], $3::int[], $4::bigint[]) AS u(t, k, o) ORDER BY t, k " +
		"ON CONFLICT (consumer_group, topic, kafka_partition) DO UPDATE " +
		"SET next_offset = EXCLUDED.next_offset, updated_at = now() WHERE p.next_offset < EXCLUDED.next_offset"
}

// upsertOne is Upsert for one partition: $2 topic, $3 partition, $4
// next offset (no arrays to build and unnest: the common case, one message
// per transaction).
func upsertOne(progressTable string) string {
	return "INSERT INTO " + progressTable + " AS p (consumer_group, topic, kafka_partition, next_offset) VALUES ($1, $2, $3, $4) " +
		"ON CONFLICT (consumer_group, topic, kafka_partition) DO UPDATE " +
		"SET next_offset = EXCLUDED.next_offset, updated_at = now() WHERE p.next_offset < EXCLUDED.next_offset"
}

// Start records that group's claim of topic/partition starts at offset
// (a negative offset, Kafka's oldest or newest for a group without a
// committed offset, records 0: from the partition's start), when the
// partition has no row yet; an existing row is left as it is. A subscriber
// calls it when it is assigned the partition, before it processes any of
// its records, so that a partition that consumed records always has a row:
// the row travels with the database, and a failover to a standby that
// lost the transactions of the records processed after it (or a restore)
// still finds where the partition started, where Kafka's committed offset
// would skip them.
func Start(ctx context.Context, q dbx.Querier, progressTable, group, topic string, partition int32, offset int64) error {
	_, err := q.Exec(ctx, "INSERT INTO "+progressTable+" (consumer_group, topic, kafka_partition, next_offset) VALUES ($1, $2, $3, $4) "+
		"ON CONFLICT (consumer_group, topic, kafka_partition) DO NOTHING", group, topic, partition, max(offset, 0))
	if err != nil {
		return fmt.Errorf("record the start of group %q on %s/%d: %w", group, topic, partition, err)
	}
	return nil
}

// Pending is the progress write a claim transaction carries: the next
// offset of each partition whose records it settles.
type Pending struct {
	table      string
	group      string
	topics     []string
	partitions []int32
	offsets    []int64
}

// NewPending returns an empty write for group into progressTable.
func NewPending(progressTable, group string) *Pending {
	return &Pending{table: progressTable, group: group}
}

// Add records that the transaction settles the record at offset of
// topic/partition; for a partition added twice the higher offset wins.
func (p *Pending) Add(topic string, partition int32, offset int64) {
	for i := range p.topics {
		if p.topics[i] == topic && p.partitions[i] == partition {
			p.offsets[i] = max(p.offsets[i], offset+1)
			return
		}
	}
	p.topics = append(p.topics, topic)
	p.partitions = append(p.partitions, partition)
	p.offsets = append(p.offsets, offset+1)
}

// Empty reports whether p writes nothing (also for a nil p).
func (p *Pending) Empty() bool { return p == nil || len(p.topics) == 0 }

// Queue adds p's statement to b (nothing for an empty p): it travels in the
// claim's batch, no round trip of its own. Its result is read by Read.
func (p *Pending) Queue(b *pgx.Batch) {
	if !p.Empty() {
		b.Queue(p.statement())
	}
}

// statement is p's SQL and arguments.
func (p *Pending) statement() (string, any, any, any, any) {
	if len(p.topics) == 1 {
		return upsertOne(p.table), p.group, p.topics[0], p.partitions[0], p.offsets[0]
	}
	return Upsert(p.table), p.group, p.topics, p.partitions, p.offsets
}

// Read reads the result of the statement Queue added (nothing for an empty p).
func (p *Pending) Read(br pgx.BatchResults) error {
	if p.Empty() {
		return nil
	}
	if _, err := br.Exec(); err != nil {
		return fmt.Errorf("record consumer progress: %w", err)
	}
	return nil
}

// Exec runs p's statement on q (a transaction), for callers without a batch.
func (p *Pending) Exec(ctx context.Context, q dbx.Querier) error {
	if p.Empty() {
		return nil
	}
	sql, a, b, c, d := p.statement()
	if _, err := q.Exec(ctx, sql, a, b, c, d); err != nil {
		return fmt.Errorf("record consumer progress: %w", err)
	}
	return nil
}

type pendingKey struct{}

// With returns ctx carrying p, for the claim that begins the transaction.
func With(ctx context.Context, p *Pending) context.Context {
	if p.Empty() {
		return ctx
	}
	return context.WithValue(ctx, pendingKey{}, p)
}

// From returns the write ctx carries, or nil (an empty write).
func From(ctx context.Context) *Pending {
	p, _ := ctx.Value(pendingKey{}).(*Pending)
	return p
}

// Position is a partition's row.
type Position struct {
	Topic     string
	Partition int32
	Next      int64
	Done      string
}

// currentTimeline is the server's timeline, 0 on a standby.
const currentTimeline = "SELECT CASE WHEN pg_is_in_recovery() THEN 0 ELSE " + timeline + " END"

// Timeline returns the server's current timeline, as Load does (0 on a
// standby): a subscriber with nothing to Save compares it with Load's to
// find a promotion or a restore before its next write.
func Timeline(ctx context.Context, q dbx.Querier) (tl int64, err error) {
	if err := q.QueryRow(ctx, currentTimeline).Scan(&tl); err != nil {
		return 0, fmt.Errorf("read timeline: %w", err)
	}
	return tl, nil
}

// Load returns the rows of group for topic ("" for every topic), ordered by
// topic and partition, and the server's current timeline (for Save's fence;
// 0 where it cannot be read, a standby).
func Load(ctx context.Context, q dbx.Querier, progressTable, group, topic string) (rows []Position, tl int64, err error) {
	if tl, err = Timeline(ctx, q); err != nil {
		return nil, 0, err
	}
	r, err := q.Query(ctx, "SELECT topic, kafka_partition, next_offset, done FROM "+progressTable+
		" WHERE consumer_group = $1 AND ($2 = '' OR topic = $2) ORDER BY topic, kafka_partition", group, topic)
	if err != nil {
		return nil, 0, fmt.Errorf("read progress of group %q: %w", group, err)
	}
	rows, err = pgx.CollectRows(r, func(row pgx.CollectableRow) (Position, error) {
		var p Position
		err := row.Scan(&p.Topic, &p.Partition, &p.Next, &p.Done)
		return p, err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("read progress of group %q: %w", group, err)
	}
	return rows, tl, nil
}

// Save sets the rows of group in one statement (positions sorted, so two
// writers cannot deadlock), only while the server is still on timeline tl
// (what Load returned): after a promotion or a restore it writes nothing
// and reports fenced, since acks seen before it may cover commits the new
// history lost. A tl of 0 writes unfenced.
func Save(ctx context.Context, q dbx.Querier, progressTable, group string, tl int64, ps []Position) (fenced bool, err error) {
	if len(ps) == 0 {
		return false, nil
	}
	ps = slices.Clone(ps)
	slices.SortFunc(ps, func(a, b Position) int {
		if a.Topic != b.Topic {
			if a.Topic < b.Topic {
				return -1
			}
			return 1
		}
		return int(a.Partition) - int(b.Partition)
	})
	topics, parts, offs, done := make([]string, len(ps)), make([]int32, len(ps)), make([]int64, len(ps)), make([]string, len(ps))
	for i, p := range ps {
		topics[i], parts[i], offs[i], done[i] = p.Topic, p.Partition, p.Next, p.Done
	}
	tag, err := q.Exec(ctx, "INSERT INTO "+progressTable+" AS p (consumer_group, topic, kafka_partition, next_offset, done) "+
		"SELECT $1, t, k, o, d FROM unnest($2::text[], $3::int[], $4::bigint[], $5::text[]) AS u(t, k, o, d) "+
		"WHERE $6::bigint = 0 OR "+timeline+" = $6::bigint "+
		"ON CONFLICT (consumer_group, topic, kafka_partition) DO UPDATE "+
		"SET next_offset = EXCLUDED.next_offset, done = EXCLUDED.done, updated_at = now()",
		group, topics, parts, offs, done, tl)
	if err != nil {
		return false, fmt.Errorf("save progress of group %q: %w", group, err)
	}
	return tag.RowsAffected() == 0, nil
}

// SubscriberKey is the context key under which a subscriber that keeps
// the progress itself (the parallel subscriber, which has many messages of
// a partition in flight) marks its messages: the middleware then writes
// none for them.
type SubscriberKey struct{}

// KeptBySubscriber reports whether ctx is a message's of such a subscriber.
func KeptBySubscriber(ctx context.Context) bool {
	kept, _ := ctx.Value(SubscriberKey{}).(bool)
	return kept
}
