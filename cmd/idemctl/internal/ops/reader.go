package ops

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/internal/progresskafka"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// Reader reads what the pages of idemctl serve show, with the library's
// functions and idemctl's own queries. Each method is one page: a fixed
// number of queries, whatever the number of rows, keys or groups (the
// outbox adds a fixed number per topic).
type Reader struct {
	Pool      *pgxpool.Pool
	Table     deduplicator.TableConfig // Layout read at each page
	Layout    string                   // --layout
	Outbox    outbox.Config            // Topics: --topics, else discovered at each page
	Parked    retrytopic.ParkedKeysTable
	Forwarder string
	Kafka     *KafkaView // nil without --brokers
}

// OverviewPage is the overview page and /api/overview. Its parts have the
// shapes of groups list, partitions list, outbox backlog and retry parked
// --json. A part that cannot be read is left empty and its error is in
// Errors (by part: groups, dedup, outbox, parked), so that one missing
// table does not hide the rest.
type OverviewPage struct {
	Now    Time           `json:"now"`
	Groups []Group        `json:"groups"`
	Dedup  *DedupOverview `json:"dedup"`
	Outbox Backlog        `json:"outbox"`
	Parked Parked         `json:"parked"`
	// Leases are lease mode's (idem.Config.Mode = &idem.LeaseConfig{}), null when unreadable.
	Leases *leasesql.Summary `json:"leases"`
	// Kafka is null without --brokers.
	Kafka  *kafkaJSON        `json:"kafka"`
	Errors map[string]string `json:"errors"`
}

// DedupOverview is the dedup table read from the catalog only: its row
// count is the planner's estimate (pg_class.reltuples, as of the last
// ANALYZE or VACUUM), never a count(*).
type DedupOverview struct {
	Schema           string      `json:"schema"`
	Table            string      `json:"table"`
	Layout           string      `json:"layout"`
	RowsEstimate     int64       `json:"rows_estimate"`
	Bytes            int64       `json:"bytes"`
	RetentionSeconds float64     `json:"retention_seconds"`
	Partitions       []Partition `json:"partitions"`
	// NextDrop is when the oldest daily partition becomes wholly older than
	// the retention, so that the Cleaner's next pass after it drops it
	// (null for a plain table, which the Cleaner deletes from in batches,
	// or without a daily partition). A young group's claims can keep it
	// longer.
	NextDrop          Time   `json:"next_drop"`
	NextDropPartition string `json:"next_drop_partition"`
	// LastCleaned is when the Cleaner's last pass ran (null: never), from
	// the cutoff it recorded.
	LastCleaned Time `json:"last_cleaned"`
}

// TableConfig is the dedup table, its layout read now unless Layout names it.
func (c *Reader) TableConfig(ctx context.Context) (deduplicator.TableConfig, error) {
	return ResolveTable(ctx, c.Pool, c.Table.Schema, c.Table.Table, c.Layout, false)
}

// topics returns the outbox topics: --topics, else those recorded.
func (c *Reader) Topics(ctx context.Context) ([]string, error) {
	if len(c.Outbox.Topics) > 0 {
		return c.Outbox.Topics, nil
	}
	return RecordedTopics(ctx, c.Pool, c.Outbox)
}

// Overview reads the overview page: the dedup table, its groups, the outbox
// backlog, the leases, the parked keys and (with Kafka) the topics' depth
// and lag; a part that fails is named in Errors.
func (c *Reader) Overview(ctx context.Context) *OverviewPage {
	now := time.Now()
	out := &OverviewPage{Now: Time(now), Groups: []Group{}, Outbox: Backlog{Forwarder: c.Forwarder, Topics: []BacklogTopic{}},
		Parked: ToParked(nil, nil), Errors: map[string]string{}}
	fail := func(part string, err error) { out.Errors[part] = Describe(err) }

	if info, err := dedupsql.Inspect(ctx, c.Pool, c.Table.Schema, c.Table.Table); err != nil {
		fail("dedup", err)
	} else {
		out.Dedup = ToDedupOverview(info)
		if gs, err := dedupsql.Groups(ctx, c.Pool, c.Table.Schema, c.Table.Table); err != nil {
			fail("groups", err)
		} else {
			for _, g := range gs {
				out.Groups = append(out.Groups, ToGroup(g, now, info.Retention))
			}
		}
	}
	if bl, err := c.ReadBacklog(ctx); err != nil {
		fail("outbox", err)
	} else {
		out.Outbox = bl
	}
	if ls, err := leasesql.Summarize(ctx, c.Pool, c.Table.Schema, c.Table.Table); err != nil {
		fail("leases", err)
	} else {
		out.Leases = &ls
	}
	if sum, err := parkedsql.Summarize(ctx, c.Pool, c.Parked.Schema, c.Parked.Table, "", deduplicator.ValidateGroupName); err != nil {
		fail("parked", err)
	} else {
		out.Parked = ToParked(sum, nil)
	}
	if c.Kafka != nil {
		if k, err := c.Kafka.read(); err != nil {
			fail("kafka", err)
		} else {
			out.Kafka = k
		}
	}
	return out
}

// ToDedupOverview is the overview's part of dedupsql.Inspect.
func ToDedupOverview(info *dedupsql.TableInfo) *DedupOverview {
	d := &DedupOverview{Schema: info.Schema, Table: info.Table, Layout: info.Layout, RowsEstimate: info.RowsEstimate, Bytes: info.Bytes,
		RetentionSeconds: info.Retention.Seconds(), Partitions: []Partition{}}
	if !info.CleanedBefore.IsZero() {
		d.LastCleaned = Time(info.CleanedBefore.Add(info.Retention))
	}
	for _, p := range info.Partitions {
		d.Partitions = append(d.Partitions, ToPartition(p))
		if p.Default || p.To.IsZero() {
			continue
		}
		if drop := p.To.Add(info.Retention); time.Time(d.NextDrop).IsZero() || drop.Before(time.Time(d.NextDrop)) {
			d.NextDrop, d.NextDropPartition = Time(drop), p.Name
		}
	}
	return d
}

// ReadBacklog reads the outbox backlog of the topics, for Forwarder.
func (c *Reader) ReadBacklog(ctx context.Context) (Backlog, error) {
	topics, err := c.Topics(ctx)
	if err != nil {
		return Backlog{}, err
	}
	if len(topics) == 0 {
		return ToBacklog(c.Forwarder, nil), nil
	}
	ob, err := outbox.New(c.Outbox, nil)
	if err != nil {
		return Backlog{}, err
	}
	bl, err := ob.Backlog(ctx, c.Pool, &outbox.BacklogOpts{Forwarder: c.Forwarder, Topics: topics})
	if err != nil {
		return Backlog{}, err
	}
	return ToBacklog(c.Forwarder, bl), nil
}

// TopicPage is one outbox topic's page and /api/outbox/{topic}.
type TopicPage struct {
	Topic     string       `json:"topic"`
	Forwarder string       `json:"forwarder"`
	Backlog   BacklogTopic `json:"backlog"`
	// Position is the forwarder's position: the snapshot whose
	// transactions' rows it has forwarded ("" when it has none yet), and
	// the cut it is part way through.
	Position  string    `json:"position"`
	Cut       string    `json:"cut"`
	CutOffset int64     `json:"cut_offset"`
	Recent    []ListRow `json:"recent"`
	Pending   []ListRow `json:"pending"`
}

// ListRow is one outbox row of a topic page.
type ListRow struct {
	Offset    int64  `json:"offset"`
	UUID      string `json:"uuid"`
	EventID   string `json:"event_id"`
	Key       string `json:"key"`
	CreatedAt Time   `json:"created_at"`
	Pending   bool   `json:"pending"`
}

// pageRows is how many rows the topic page lists, newest and oldest
// pending.
const pageRows = 20

// Topic reads one outbox topic's page: its backlog, the forwarder's
// position, the newest rows and the oldest pending; ErrNotFound for a topic
// that is not the outbox's.
func (c *Reader) Topic(ctx context.Context, topic string) (*TopicPage, error) {
	topics, err := c.Topics(ctx)
	if err != nil {
		return nil, err
	}
	known := false
	for _, t := range topics {
		known = known || t == topic
	}
	if !known {
		return nil, ErrNotFound
	}
	ob, err := outbox.New(c.Outbox, nil)
	if err != nil {
		return nil, err
	}
	out := &TopicPage{Topic: topic, Forwarder: c.Forwarder, Recent: []ListRow{}, Pending: []ListRow{}}
	bl, err := ob.Backlog(ctx, c.Pool, &outbox.BacklogOpts{Forwarder: c.Forwarder, Topics: []string{topic}})
	if err != nil {
		return nil, err
	}
	out.Backlog = ToBacklog(c.Forwarder, bl).Topics[0]
	t := outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, topic)
	p, err := t.Position(ctx, c.Pool, c.Forwarder)
	switch {
	case errors.Is(err, outboxsql.ErrNoPosition):
		p = outboxsql.Position{Snapshot: outboxsql.Start}
	case err != nil:
		return nil, err
	default:
		out.Position = p.Snapshot.String()
		if p.Cut != nil {
			out.Cut, out.CutOffset = p.Cut.String(), p.CutOffset
		}
	}
	for _, pendingOnly := range []bool{false, true} {
		rows, err := t.ListRows(ctx, c.Pool, p, pendingOnly, pageRows)
		if err != nil {
			return nil, fmt.Errorf("rows of %s: %w", topic, err)
		}
		for _, r := range rows {
			jr := ListRow{r.Offset, r.UUID, r.EventID, r.Key, Time(r.CreatedAt), r.Pending}
			if pendingOnly {
				out.Pending = append(out.Pending, jr)
			} else {
				out.Recent = append(out.Recent, jr)
			}
		}
	}
	return out, nil
}

// GroupPage is one consumer group's page and /api/groups/{group}.
type GroupPage struct {
	Group            Group   `json:"group"`
	RetentionSeconds float64 `json:"retention_seconds"`
	// StaleHorizon: the group's consumers refuse as stale
	// (ErrStaleEvent) an event created before it, less the consumers'
	// StaleMargin; null while the group is young (it has lost no claim).
	StaleHorizon Time `json:"stale_horizon"`
	// YoungUntil is when the group stops being young.
	YoungUntil Time `json:"young_until"`
	// Progress is the group's position in PostgreSQL per partition (its
	// rows in <table>_progress), beside the Kafka consumer group of the
	// same name's committed offset when the console reads Kafka.
	Progress []ProgressRow `json:"progress"`
	// KafkaAhead sums how far Kafka's committed offsets are past
	// PostgreSQL's position: records a failover or a restore may have
	// lost (stop the consumers, idemctl groups progress GROUP --rewind).
	KafkaAhead int64 `json:"kafka_ahead"`
	// ProgressError says why Kafka's committed offsets could not be read
	// (the positions are then PostgreSQL's alone); empty when they were.
	ProgressError string `json:"progress_error,omitempty"`
}

// ProgressRow is one partition of [GroupPage.Progress].
type ProgressRow struct {
	Topic     string `json:"topic"`
	Partition int32  `json:"partition"`
	// Postgres is the next offset to process, as PostgreSQL holds it.
	Postgres int64 `json:"postgres_offset"`
	// Kafka is the group's committed offset: -1 when it has none or the
	// console does not read Kafka.
	Kafka int64 `json:"kafka_offset"`
	Ahead int64 `json:"kafka_ahead"`
}

// Group reads one consumer group's page; ErrNotFound for a group that is
// not registered.
func (c *Reader) Group(ctx context.Context, name string) (*GroupPage, error) {
	tc, err := c.TableConfig(ctx)
	if err != nil {
		return nil, err
	}
	retention, err := RecordedRetention(ctx, c.Pool, tc)
	if err != nil {
		return nil, err
	}
	gs, err := dedupsql.Groups(ctx, c.Pool, tc.Schema, tc.Table)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	for _, g := range gs {
		if g.Name != name {
			continue
		}
		out := &GroupPage{Group: ToGroup(g, now, retention), RetentionSeconds: retention.Seconds()}
		if !g.FirstSeen.IsZero() {
			out.YoungUntil = Time(g.FirstSeen.Add(retention))
		}
		if !g.Young(now, retention) {
			out.StaleHorizon = Time(now.Add(-retention))
		}
		if out.Progress, err = c.progress(ctx, tc, name, true); err != nil {
			// Kafka unreachable: the page still shows PostgreSQL's side.
			out.ProgressError = err.Error()
			if out.Progress, err = c.progress(ctx, tc, name, false); err != nil {
				return nil, err
			}
		}
		for _, r := range out.Progress {
			out.KafkaAhead += r.Ahead
		}
		return out, nil
	}
	return nil, ErrNotFound
}

// progress reads group's position in PostgreSQL and, withKafka and a
// KafkaView, its committed offsets (the Kafka consumer group of the same
// name, as idemctl groups progress assumes by default). A table from before the
// progress migration has no position: none.
func (c *Reader) progress(ctx context.Context, tc deduplicator.TableConfig, group string, withKafka bool) ([]ProgressRow, error) {
	table := progresssql.Table(tc.Schema, tc.Table)
	var rows []progresskafka.Row
	var err error
	if withKafka && c.Kafka != nil {
		rows, err = c.Kafka.progress(ctx, c.Pool, table, group)
	} else {
		var ps []progresssql.Position
		ps, _, err = progresssql.Load(ctx, c.Pool, table, group, "")
		for _, p := range ps {
			rows = append(rows, progresskafka.Row{Topic: p.Topic, Partition: p.Partition, Postgres: p.Next, Kafka: -1})
		}
	}
	if pgerr.Has(err, pgerrcode.UndefinedTable) {
		return []ProgressRow{}, nil
	}
	if err != nil {
		return nil, err
	}
	out := make([]ProgressRow, 0, len(rows))
	for _, r := range rows {
		out = append(out, ProgressRow{Topic: r.Topic, Partition: r.Partition, Postgres: r.Postgres, Kafka: r.Kafka, Ahead: r.Ahead()})
	}
	return out, nil
}

// Describe words err for a page: a missing grant says which.
func Describe(err error) string {
	if pgerr.Has(err, pgerrcode.InsufficientPrivilege) {
		return "the database role lacks a grant for this (docs/security.md, idemctl): " + err.Error()
	}
	return MissingTable(err).Error()
}

// leasesPageLimit is the most leases the leases page lists.
const leasesPageLimit = 200

// LeasesPage is the leases page and /api/leases: the shape of idemctl
// dedup leases --json.
type LeasesPage struct {
	Leases []leasesql.Lease `json:"leases"`
}

// leases lists lease mode's leases, oldest taken first.
func (c *Reader) Leases(ctx context.Context) (LeasesPage, error) {
	tc, err := c.TableConfig(ctx)
	if err != nil {
		return LeasesPage{}, err
	}
	ls, err := leasesql.List(ctx, c.Pool, tc.Schema, tc.Table, leasesql.Filter{Limit: leasesPageLimit})
	if err != nil {
		return LeasesPage{}, err
	}
	if ls == nil {
		ls = []leasesql.Lease{}
	}
	return LeasesPage{Leases: ls}, nil
}
