package console

import (
	"context"
	"errors"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// reader reads what the pages of idemctl serve show, with the library's
// functions and idemctl's own queries. Each method is one page: a fixed
// number of queries, whatever the number of rows, keys or groups (the
// outbox adds a fixed number per topic).
type reader struct {
	pool      *pgxpool.Pool
	table     deduplicator.TableConfig // Layout read at each page
	layout    string                   // --layout
	outbox    outbox.Config            // Topics: --topics, else discovered at each page
	parked    retrytopic.ParkedKeysTable
	forwarder string
	kafka     *KafkaView // nil without --brokers
}

// overviewJSON is the overview page and /api/overview. Its parts have the
// shapes of groups list, partitions list, outbox backlog and retry parked
// --json. A part that cannot be read is left empty and its error is in
// Errors (by part: groups, dedup, outbox, parked), so that one missing
// table does not hide the rest.
type overviewJSON struct {
	Now    ops.Time       `json:"now"`
	Groups []ops.Group    `json:"groups"`
	Dedup  *dedupOverview `json:"dedup"`
	Outbox ops.Backlog    `json:"outbox"`
	Parked ops.Parked     `json:"parked"`
	// Leases are lease mode's (idem.Config.Lease), null when unreadable.
	Leases *leasesql.Summary `json:"leases"`
	// Kafka is null without --brokers.
	Kafka  *kafkaJSON        `json:"kafka"`
	Errors map[string]string `json:"errors"`
}

// dedupOverview is the dedup table read from the catalog only: its row
// count is the planner's estimate (pg_class.reltuples, as of the last
// ANALYZE or VACUUM), never a count(*).
type dedupOverview struct {
	Schema           string          `json:"schema"`
	Table            string          `json:"table"`
	Layout           string          `json:"layout"`
	RowsEstimate     int64           `json:"rows_estimate"`
	Bytes            int64           `json:"bytes"`
	RetentionSeconds float64         `json:"retention_seconds"`
	Partitions       []ops.Partition `json:"partitions"`
	// NextDrop is when the oldest daily partition becomes wholly older than
	// the retention, so that the Cleaner's next pass after it drops it
	// (null for a plain table, which the Cleaner deletes from in batches,
	// or without a daily partition). A young group's claims can keep it
	// longer.
	NextDrop          ops.Time `json:"next_drop"`
	NextDropPartition string   `json:"next_drop_partition"`
	// LastCleaned is when the Cleaner's last pass ran (null: never), from
	// the cutoff it recorded.
	LastCleaned ops.Time `json:"last_cleaned"`
}

func (c *reader) tableConfig(ctx context.Context) (deduplicator.TableConfig, error) {
	return ops.ResolveTable(ctx, c.pool, c.table.Schema, c.table.Table, c.layout, false)
}

// topics returns the outbox topics: --topics, else those recorded.
func (c *reader) topics(ctx context.Context) ([]string, error) {
	if len(c.outbox.Topics) > 0 {
		return c.outbox.Topics, nil
	}
	return ops.RecordedTopics(ctx, c.pool, c.outbox)
}

func (c *reader) overview(ctx context.Context) *overviewJSON {
	now := time.Now()
	out := &overviewJSON{Now: ops.Time(now), Groups: []ops.Group{}, Outbox: ops.Backlog{Forwarder: c.forwarder, Topics: []ops.BacklogTopic{}},
		Parked: ops.ToParked(nil, nil), Errors: map[string]string{}}
	fail := func(part string, err error) { out.Errors[part] = consoleError(err) }

	if info, err := dedupsql.Inspect(ctx, c.pool, c.table.Schema, c.table.Table); err != nil {
		fail("dedup", err)
	} else {
		out.Dedup = toDedupOverview(info)
		if gs, err := dedupsql.Groups(ctx, c.pool, c.table.Schema, c.table.Table); err != nil {
			fail("groups", err)
		} else {
			for _, g := range gs {
				out.Groups = append(out.Groups, ops.ToGroup(g, now, info.Retention))
			}
		}
	}
	if bl, err := c.backlog(ctx); err != nil {
		fail("outbox", err)
	} else {
		out.Outbox = bl
	}
	if ls, err := leasesql.Summarize(ctx, c.pool, c.table.Schema, c.table.Table); err != nil {
		fail("leases", err)
	} else {
		out.Leases = &ls
	}
	if sum, err := parkedsql.Summarize(ctx, c.pool, c.parked.Schema, c.parked.Table, "", deduplicator.ValidateGroupName); err != nil {
		fail("parked", err)
	} else {
		out.Parked = ops.ToParked(sum, nil)
	}
	if c.kafka != nil {
		if k, err := c.kafka.read(); err != nil {
			fail("kafka", err)
		} else {
			out.Kafka = k
		}
	}
	return out
}

// toDedupOverview is the overview's part of dedupsql.Inspect.
func toDedupOverview(info *dedupsql.TableInfo) *dedupOverview {
	d := &dedupOverview{Schema: info.Schema, Table: info.Table, Layout: info.Layout, RowsEstimate: info.RowsEstimate, Bytes: info.Bytes,
		RetentionSeconds: info.Retention.Seconds(), Partitions: []ops.Partition{}}
	if !info.CleanedBefore.IsZero() {
		d.LastCleaned = ops.Time(info.CleanedBefore.Add(info.Retention))
	}
	for _, p := range info.Partitions {
		d.Partitions = append(d.Partitions, ops.ToPartition(p))
		if p.Default || p.To.IsZero() {
			continue
		}
		if drop := p.To.Add(info.Retention); time.Time(d.NextDrop).IsZero() || drop.Before(time.Time(d.NextDrop)) {
			d.NextDrop, d.NextDropPartition = ops.Time(drop), p.Name
		}
	}
	return d
}

func (c *reader) backlog(ctx context.Context) (ops.Backlog, error) {
	topics, err := c.topics(ctx)
	if err != nil {
		return ops.Backlog{}, err
	}
	if len(topics) == 0 {
		return ops.ToBacklog(c.forwarder, nil), nil
	}
	ob, err := outbox.New(c.outbox, nil)
	if err != nil {
		return ops.Backlog{}, err
	}
	bl, err := ob.Backlog(ctx, c.pool, &outbox.BacklogOpts{Forwarder: c.forwarder, Topics: topics})
	if err != nil {
		return ops.Backlog{}, err
	}
	return ops.ToBacklog(c.forwarder, bl), nil
}

// topicJSON is one outbox topic's page and /api/outbox/{topic}.
type topicJSON struct {
	Topic     string           `json:"topic"`
	Forwarder string           `json:"forwarder"`
	Backlog   ops.BacklogTopic `json:"backlog"`
	// Position is the forwarder's position: the snapshot whose
	// transactions' rows it has forwarded ("" when it has none yet), and
	// the cut it is part way through.
	Position  string        `json:"position"`
	Cut       string        `json:"cut"`
	CutOffset int64         `json:"cut_offset"`
	Recent    []jsonListRow `json:"recent"`
	Pending   []jsonListRow `json:"pending"`
}

type jsonListRow struct {
	Offset    int64    `json:"offset"`
	UUID      string   `json:"uuid"`
	EventID   string   `json:"event_id"`
	Key       string   `json:"key"`
	CreatedAt ops.Time `json:"created_at"`
	Pending   bool     `json:"pending"`
}

// pageRows is how many rows the topic page lists, newest and oldest
// pending.
const pageRows = 20

func (c *reader) topic(ctx context.Context, topic string) (*topicJSON, error) {
	topics, err := c.topics(ctx)
	if err != nil {
		return nil, err
	}
	known := false
	for _, t := range topics {
		known = known || t == topic
	}
	if !known {
		return nil, ops.ErrNotFound
	}
	ob, err := outbox.New(c.outbox, nil)
	if err != nil {
		return nil, err
	}
	out := &topicJSON{Topic: topic, Forwarder: c.forwarder, Recent: []jsonListRow{}, Pending: []jsonListRow{}}
	bl, err := ob.Backlog(ctx, c.pool, &outbox.BacklogOpts{Forwarder: c.forwarder, Topics: []string{topic}})
	if err != nil {
		return nil, err
	}
	out.Backlog = ops.ToBacklog(c.forwarder, bl).Topics[0]
	t := outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, topic)
	p, err := t.Position(ctx, c.pool, c.forwarder)
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
		rows, err := t.ListRows(ctx, c.pool, p, pendingOnly, pageRows)
		if err != nil {
			return nil, fmt.Errorf("rows of %s: %w", topic, err)
		}
		for _, r := range rows {
			jr := jsonListRow{r.Offset, r.UUID, r.EventID, r.Key, ops.Time(r.CreatedAt), r.Pending}
			if pendingOnly {
				out.Pending = append(out.Pending, jr)
			} else {
				out.Recent = append(out.Recent, jr)
			}
		}
	}
	return out, nil
}

// groupJSON is one consumer group's page and /api/groups/{group}.
type groupJSON struct {
	Group            ops.Group `json:"group"`
	RetentionSeconds float64   `json:"retention_seconds"`
	// StaleHorizon: the group's consumers refuse as stale
	// (ErrStaleEvent) an event created before it, less the consumers'
	// StaleMargin; null while the group is young (it has lost no claim).
	StaleHorizon ops.Time `json:"stale_horizon"`
	// YoungUntil is when the group stops being young.
	YoungUntil ops.Time `json:"young_until"`
}

func (c *reader) group(ctx context.Context, name string) (*groupJSON, error) {
	tc, err := c.tableConfig(ctx)
	if err != nil {
		return nil, err
	}
	retention, err := ops.RecordedRetention(ctx, c.pool, tc)
	if err != nil {
		return nil, err
	}
	gs, err := dedupsql.Groups(ctx, c.pool, tc.Schema, tc.Table)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	for _, g := range gs {
		if g.Name != name {
			continue
		}
		out := &groupJSON{Group: ops.ToGroup(g, now, retention), RetentionSeconds: retention.Seconds()}
		if !g.FirstSeen.IsZero() {
			out.YoungUntil = ops.Time(g.FirstSeen.Add(retention))
		}
		if !g.Young(now, retention) {
			out.StaleHorizon = ops.Time(now.Add(-retention))
		}
		return out, nil
	}
	return nil, ops.ErrNotFound
}

// consoleError words err for a page: a missing grant says which.
func consoleError(err error) string {
	if pgerr.Has(err, pgerrcode.InsufficientPrivilege) {
		return "the database role lacks a grant for this (docs/security.md, idemctl): " + err.Error()
	}
	return ops.MissingTable(err).Error()
}

// leasesPageLimit is the most leases the leases page lists.
const leasesPageLimit = 200

// leasesJSON is the leases page and /api/leases: the shape of idemctl
// dedup leases --json.
type leasesJSON struct {
	Leases []leasesql.Lease `json:"leases"`
}

// leases lists lease mode's leases, oldest taken first.
func (c *reader) leases(ctx context.Context) (leasesJSON, error) {
	tc, err := c.tableConfig(ctx)
	if err != nil {
		return leasesJSON{}, err
	}
	ls, err := leasesql.List(ctx, c.pool, tc.Schema, tc.Table, leasesql.Filter{Limit: leasesPageLimit})
	if err != nil {
		return leasesJSON{}, err
	}
	if ls == nil {
		ls = []leasesql.Lease{}
	}
	return leasesJSON{Leases: ls}, nil
}
